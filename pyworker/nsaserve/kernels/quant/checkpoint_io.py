"""Streaming access to Hugging Face safetensors checkpoints: read one tensor at a time, write shards.

A checkpoint directory holds either one ``model.safetensors`` (or any ``*.safetensors`` files) or
shards listed in ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
"weight_map": {tensor name: file name}}``). Neither class ever holds more than one output shard.
"""

import json
import os
from contextlib import ExitStack

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"


class CheckpointReader:
    """Lazily opened safetensors files of one directory; use as a context manager."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        if os.path.exists(index_path):
            with open(index_path) as f:
                self.file_of: dict[str, str] = dict(json.load(f)["weight_map"])
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {directory}")
            self.file_of = {}
            for name in files:
                for key in self._handle(name).keys():
                    self.file_of[key] = name

    def _handle(self, file_name: str):
        if file_name not in self._handles:
            path = os.path.join(self.directory, file_name)
            self._handles[file_name] = self._stack.enter_context(safe_open(path, framework="pt", device="cpu"))
        return self._handles[file_name]

    def names(self) -> list[str]:
        """Tensor names grouped by file (so files are read in order), sorted within a file."""
        return sorted(self.file_of, key=lambda n: (self.file_of[n], n))

    def shape(self, name: str) -> list[int]:
        return list(self._handle(self.file_of[name]).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype string (e.g. "BF16", "F32", "U8") without loading the data."""
        return self._handle(self.file_of[name]).get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.file_of[name]).get_tensor(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()


class ShardedWriter:
    """Collects output tensors and writes a shard whenever ``max_shard_bytes`` would be exceeded.

    ``close()`` names the files: a single shard becomes ``model.safetensors`` (no index), several become
    ``model-0000i-of-0000n.safetensors`` plus the index file.
    """

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self._seen: set[str] = set()
        self.total_bytes = 0
        os.makedirs(directory, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ValueError(f"tensor {name} written twice")
        self._seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        temp_name = f"partial-{len(self._shards):05d}.safetensors"
        save_file(self._pending, os.path.join(self.directory, temp_name), metadata={"format": "pt"})
        self._shards.append((temp_name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is pending, give the shards their final names; returns the file names."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        final_names = (
            ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        for (temp_name, _), final in zip(self._shards, final_names):
            os.replace(os.path.join(self.directory, temp_name), os.path.join(self.directory, final))
        if n > 1:
            weight_map = {t: final for (_, names), final in zip(self._shards, final_names) for t in names}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        return final_names
