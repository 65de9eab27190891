"""Module-scoped fixtures of the GLM-5 end-to-end tests: a GLM-5-shaped model directory, a script
of replies, a real `nsaserve serve` with `--reasoning-parser glm45 --tool-call-parser glm47`
running the scripted executor, and the official `openai` client against it. A test module
loads them with `pytest_plugins = ["glm_parser_server"]`."""

from __future__ import annotations

import pytest
from glm_model_dir import write_glm_model_dir
from scripted_replies import Script, start_scripted_server


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return write_glm_model_dir(tmp_path_factory.mktemp("glm5-shaped"))


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return Script(tmp_path_factory.mktemp("script"))


@pytest.fixture(scope="module")
def server(script, glm_dir):
    s = start_scripted_server(
        script, glm_dir, "--served-model-name=glm", "--reasoning-parser=glm45", "--tool-call-parser=glm47"
    )
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
