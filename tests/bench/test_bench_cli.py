"""`nsaserve bench` on the command line: every flag documented, sweep levels, JSON-safe args."""

from __future__ import annotations

import argparse

import pytest

from nsaserve.bench.main import json_args, levels
from nsaserve.cli import build_parser


def bench_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["bench"]


def test_every_bench_flag_has_help():
    for action in bench_parser()._actions:
        if action.option_strings:
            assert action.help and action.help.strip(), action.option_strings


def test_sglang_flag_names_parse():
    args = build_parser().parse_args(
        "bench --base-url http://h:1 --dataset-name random --num-prompts 5 --random-input-len 9 --random-output-len 3 "
        "--random-range-ratio 0.8 --request-rate 4 --max-concurrency 2 --seed 7 --warmup-requests 0 --output-file x.json".split()
    )
    assert (args.num_prompts, args.random_range_ratio, args.request_rate, args.max_concurrency) == (5, 0.8, 4.0, 2)


def test_sweep_levels_and_prompts_per_level():
    p = build_parser()
    assert levels(p.parse_args(["bench", "--max-concurrency", "8"])) == [(8, 1000)]
    assert levels(p.parse_args(["bench", "--concurrency", "4,16", "--num-prompts", "50"])) == [(4, 50), (16, 50)]
    assert levels(p.parse_args(["bench", "--concurrency", "4,16", "--prompts-per-concurrency", "10"])) == [(4, 40), (16, 160)]
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--concurrency", "4,0"])


def test_an_infinite_rate_is_written_as_a_string():
    assert json_args(build_parser().parse_args(["bench"]))["request_rate"] == "inf"
