"""Benchmark: the worker's per-step host work for a decode plan of 1024 running requests
(~2K tokens of context each, 32 pages of 64): msgpack decode, validation, and expansion into
device-ready tensors (`build_forward_batch`). Ceiling measured in the same run: msgpack decode
plus zero-copy numpy views alone (the least any decoder must do).

    python bench/bench_plan_decode.py [--device cpu|cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nsaserve.protocol.builder import RequestSpec, SamplingSpec, build_plan
from nsaserve.protocol.messages import encode_plan, plan_from_msg, unpack
from nsaserve.protocol.validate import validate_plan
from nsaserve.worker.batch import build_forward_batch, expand_slots, stage_plan

REQUESTS, PAGES_PER_REQUEST, PAGE, POOL = 1024, 32, 64, 40_000


def decode_plan_bytes() -> bytes:
    reqs = []
    for i in range(REQUESTS):
        pages = [(i * PAGES_PER_REQUEST + k * 7919) % POOL for k in range(PAGES_PER_REQUEST)]
        cached = (PAGES_PER_REQUEST - 1) * PAGE + i % 60
        reqs.append(RequestSpec(i, [i * 31 % 150_000], cached, pages, sampling=SamplingSpec(temperature=0.7, top_p=0.95)))
    return encode_plan(build_plan(1, PAGE, reqs))


def time_us(fn, iters: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device(args.device)
    data = decode_plan_bytes()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def host_part():
        plan, _ = validate_plan(plan_from_msg(unpack(data)), POOL)
        staged = stage_plan(plan, device)
        sync()
        return staged

    def ceiling():
        return plan_from_msg(unpack(data))

    def validate_only():
        return validate_plan(plan_from_msg(unpack(data)), POOL)

    # The O(total context) part, done on the device: pages expanded into per-position slots.
    st = host_part()
    t = st.tensors

    def expansion():
        out = expand_slots(t["page_table"], t["page_start"], t["seq_lens"], t["kv_start"], PAGE, st.total_kv)
        sync()
        return out

    assert torch.equal(expansion(), build_forward_batch(st.plan, device).kv_slots)
    host_p50, host_p99 = time_us(host_part, args.iters)
    val_p50, _ = time_us(validate_only, args.iters)
    ceil_p50, _ = time_us(ceiling, args.iters)
    exp_p50, _ = time_us(expansion, max(20, args.iters // 10))
    report = {
        "benchmark": "plan_decode",
        "device": args.device,
        "requests": REQUESTS,
        "pages_per_request": PAGES_PER_REQUEST,
        "plan_bytes": len(data),
        "iterations": args.iters,
        "decode_validate_stage_on_device_us": {"p50": host_p50, "p99": host_p99},
        "device_slot_expansion_us": {"p50": exp_p50, "positions": st.total_kv},
        "decode_validate_us": {"p50": val_p50},
        "ceiling_msgpack_and_views_us": {"p50": ceil_p50},
        "host_over_ceiling": host_p50 / ceil_p50,
        "target_p50_us": 300.0,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
