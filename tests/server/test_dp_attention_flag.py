"""`serve --enable-dp-attention`: the router config and every worker get it, one rank is refused
with a clear error before anything starts, and two ranks serve end to end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from server_process import DEVICE_FLAG

from nsaserve.cli import build_parser
from nsaserve.serve import EMBEDDED_MODEL, ServeError, Supervisor, router_config, worker_command


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--model-path=m", *flags])


def test_off_by_default_and_passed_to_the_router_and_every_worker():
    off = serve_args("--tp=2")
    assert router_config(off, "/ipc", "m")["enable_dp_attention"] is False
    assert "--enable-dp-attention" not in worker_command(off, 0, "/ipc", None, "m", "cpu")
    on = serve_args("--tp=2", "--enable-dp-attention")
    assert router_config(on, "/ipc", "m")["enable_dp_attention"] is True
    for rank in (0, 1):
        assert "--enable-dp-attention" in worker_command(on, rank, "/ipc", None, "m", "cpu")


def test_one_rank_is_refused():
    with pytest.raises(ServeError, match="--enable-dp-attention needs --tp >= 2"):
        Supervisor(serve_args("--enable-dp-attention")).start()


@pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")
def test_two_ranks_serve_their_own_requests_and_recite_exactly(start_server):
    """End to end on the embedded model: with --tp 2 --enable-dp-attention the router spreads
    concurrent requests over both ranks' pools (each rank's attention on its own requests, the
    MLPs over all of them) and every greedy completion is the recitation one rank gives."""
    server = start_server("--tp=2", "--enable-dp-attention", DEVICE_FLAG)
    prompts = {"Errors should never": " pass silently.\nUnless explicitly silenced.",
               "Beautiful is better than": " ugly.\nExplicit is better than implicit."}  # fmt: skip
    choices = ["better than nested", "worse", "fine"]
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda p: (p, server.complete(p, max_tokens=12)), list(prompts) * 3))
        # Structured outputs on both ranks: each rank's rows carry their masks through its sampler.
        chosen = list(pool.map(lambda p: server.complete(p, max_tokens=12, guided_choice=choices), ["Flat is"] * 4))
        matched = list(pool.map(lambda p: server.complete(p, max_tokens=12, guided_regex="[0-9]{2}-[a-z]{3}"), ["Now"] * 4))
    for prompt, text in texts:
        assert text.startswith(prompts[prompt]), (prompt, text)
    assert all(text in choices for text in chosen), chosen
    assert all(len(t) == 6 and t[:2].isdigit() and t[2] == "-" and t[3:].isalpha() for t in matched), matched
    dp_pages = server.metrics()["nsaserve_kv_pages_total"]
    ready = next(line for line in server.lines if "nsaserve ready" in line)
    assert f"data-parallel attention, 2 x {dp_pages // 2:.0f} = {dp_pages:.0f} KV pages" in ready, ready
    assert server.stop() == 0
    # Each rank's own pool counts: twice the pages of the same two ranks sharing one latent cache.
    tp = start_server("--tp=2", DEVICE_FLAG)
    assert dp_pages == 2 * tp.metrics()["nsaserve_kv_pages_total"] > 0
    assert tp.stop() == 0
