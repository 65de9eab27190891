"""Kernels: pure functions over tensors, each with a torch reference, picked through a registry.

This package never imports the worker or the model.
"""
