"""`serve --sampling-defaults`: the router gets it (model by default, as in vLLM and SGLang), and
an invalid sampling value in the model's generation_config.json stops serve in one line before
any worker starts."""

from __future__ import annotations

import json

import pytest

from nsaserve.cli import build_parser
from nsaserve.serve import ServeError, Supervisor, router_config


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--model-path=m", *flags])


def test_model_by_default_and_passed_to_the_router():
    assert router_config(serve_args(), "/ipc", "m")["sampling_defaults"] == "model"
    openai = serve_args("--sampling-defaults=openai")
    assert router_config(openai, "/ipc", "m")["sampling_defaults"] == "openai"
    with pytest.raises(SystemExit):
        serve_args("--sampling-defaults=vllm")


def test_an_invalid_generation_config_value_is_a_startup_error(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 1.5}))
    # No worker may start: the router refuses its configuration first.
    monkeypatch.setattr(Supervisor, "spawn_workers", lambda self: pytest.fail("workers started"))
    sup = Supervisor(build_parser().parse_args(["serve", f"--model-path={tmp_path}", "--device=cpu"]))
    try:
        with pytest.raises(ServeError, match=r"generation_config\.json.*`top_p` must be in \(0, 1\], got 1\.5"):
            sup.start()
    finally:
        sup.stop()
