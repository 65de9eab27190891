import os
import sys

# The helpers next to these tests (model_helpers.py) are imported by name.
sys.path.insert(0, os.path.dirname(__file__))
