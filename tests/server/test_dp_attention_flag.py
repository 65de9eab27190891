"""`serve --enable-dp-attention`: the router config and every worker get it, and one rank is refused
with a clear error before anything starts."""

from __future__ import annotations

import pytest

from nsaserve.cli import build_parser
from nsaserve.serve import ServeError, Supervisor, router_config, worker_command


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
