"""`cache_salt` end to end: a prompt's cached prefix is reused only by requests with the same
salt (usage.prompt_tokens_details.cached_tokens says how many prompt tokens came from the
cache), and the output does not depend on the salt."""

from __future__ import annotations

import json
import urllib.request

import pytest
from server_process import DEVICE_FLAG

from nsaserve.serve import EMBEDDED_MODEL

PROMPT = (
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
    "Complex is better than complicated. Flat is better than nested. Sparse is better than dense."
)


@pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")
def test_the_prefix_cache_is_shared_only_under_the_same_salt(start_server):
    server = start_server(DEVICE_FLAG, "--page-size=16")

    def complete(salt: str | None) -> tuple[str, int]:
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        req = urllib.request.Request(
            server.base_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    runs = [(salt, *complete(salt)) for salt in ["tenant-a", "tenant-a", "tenant-b", None, None, "tenant-b"]]
    cached = [c for _, _, c in runs]
    assert cached[0] == 0 and cached[2] == 0 and cached[3] == 0, runs
    assert cached[1] > 0 and cached[4] > 0 and cached[5] > 0, runs
    assert len({text for _, text, _ in runs}) == 1, runs
    assert server.stop() == 0
