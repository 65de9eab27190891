"""Driving a server that runs the test-only scripted executor
(pyworker/nsaserve/worker/scripted_executor.py): each test registers the reply it wants under a
fresh marker, puts the marker in its prompt, and reads back the prompt the worker received."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from server_process import ServerProcess

SCRIPT_ENV = "NSASERVE_TEST_SCRIPT"


class Script:
    def __init__(self, directory: Path):
        self.path = directory / "script.json"
        self.record = directory / "prompts.jsonl"
        self.replies: list[dict] = []
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"record": str(self.record), "replies": self.replies}))
        os.replace(tmp, self.path)  # the executor never sees a half-written script

    def reply(self, text: str) -> str:
        """Registers `text` as the model's output for prompts containing the returned marker."""
        marker = f"case-{uuid.uuid4().hex[:10]}"
        self.replies.append({"marker": marker, "text": text})
        self._write()
        return marker

    def prompts(self, marker: str) -> list[dict]:
        """What the worker recorded for each request answered with `marker`'s reply."""
        if not self.record.exists():
            return []
        lines = [json.loads(line) for line in self.record.read_text().splitlines()]
        return [r for r in lines if r["marker"] == marker]


def start_scripted_server(script: Script, model_dir: Path, *flags: str) -> ServerProcess:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SCRIPT_ENV, str(script.path))
        server = ServerProcess(f"--model-path={model_dir}", "--model-executor=null", "--device=cpu", *flags)
    return server.wait_ready()
