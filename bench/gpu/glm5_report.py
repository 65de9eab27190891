"""Markdown for bench/results/ from a results.json of glm5_sweep.py:
python bench/gpu/glm5_report.py results.json [--title TEXT] > bench/results/DATE-glm5-shaped-h200.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from glm5_summary import summary_table  # noqa: E402


def report(doc: dict, title: str) -> str:
    p, params = doc["phases"], doc["params"]
    ck = doc.get("checkpoint", {})
    roof = doc.get("roofline_model", {})
    lines = [
        f"# {title}",
        "",
        f"Date: {doc['date']}. Machine: {doc.get('machine', {})}.",
        f"Command: `{doc['command']}` (elapsed {doc.get('elapsed_s')} s).",
        f"Server: `{doc.get('serve_command', 'n/a')}`.",
        f"Checkpoint: {ck.get('dense_layers')} dense + {ck.get('moe_layers')} MoE layers at GLM-5 shapes, NVFP4 routed "
        f"experts, bf16 elsewhere, random weights "
        + (
            f"drawn on every rank's GPU at load (--load-format random: the generator's tensors, about "
            f"{ck.get('estimated_gb')} GB in all, nothing on disk; config at {ck.get('path')})."
            if ck.get("random_weights")
            else f"({ck.get('size_gb')} GB, "
            f"{'reused' if ck.get('reused') else 'generated in ' + str(ck.get('generate_s')) + ' s'}, at {ck.get('path')})."
        ),
        f"Server ready in {p.get('serve', {}).get('ready_s')} s: {p.get('serve', {}).get('ready_line', '')}; "
        f"GPU memory after load: {p.get('serve', {}).get('gpu_memory')}.",
        f"Load: random {params['input_len']} in / {params['output_len']} out, range ratio {params['range_ratio']} "
        f"(sglang's meaning), prompts per level = waves x concurrency (waves {params['waves']}, per level: "
        f"{params.get('level_waves') or 'none'}), warm-up: {params.get('warmup_prompts') or 0} requests "
        f"before the first level, ignore_eos.",
        f"Roofline: per decode step, fixed weights {roof.get('fixed_weight_gb')} GB (attention, dense MLPs, shared "
        f"experts, routers, lm_head) + {roof.get('expert_mb')} MB per distinct routed expert per MoE layer "
        f"(uniform routing) + KV ({roof.get('latent_row_bytes')} B latent rows selected, {roof.get('index_row_bytes')} B "
        f"indexer keys of the whole context), divided by the device copy bandwidth measured in the same run "
        f"({doc.get('bandwidth_tb_s')} TB/s, read + write). Step times: the worker's step log, decode-only steps "
        f"with at least 90% of the level's requests (all decode steps when none)."
        + (
            f" Tensor parallel over {doc['machine']['tp']} GPUs: the roofline is one rank's bytes (split tensors "
            "1/tp, the rank's share of the experts, replicated attention inputs, indexer and KV in full) over one "
            "GPU's bandwidth; the all-reduces are not in it."
            + (
                " Data-parallel attention: the whole attention on every rank, each rank reading its own "
                "requests' KV (the step's over tp)."
                if "--enable-dp-attention" in doc.get("serve_command", "")
                else ""
            )
            if doc.get("machine", {}).get("tp", 1) > 1
            else ""
        ),
        "",
        summary_table(doc),
        "",
    ]
    cached = [e["concurrency"] for e in p.get("sweep", []) if (e["bench"].get("prefix_hit_rate") or 0) > 0.05]
    if cached:
        lines += [
            f"Prefix hits at concurrency {', '.join(map(str, cached))}: that level drew the same prompts as an "
            "earlier run on the same server (the sweep then passed one seed to every run), so its prompts were "
            "mostly in the radix cache: its prefill was nearly free and its TTFT and total tok/s are not those of "
            "new prompts; decode steps are unaffected. The sweep now draws fresh prompts for every run.",
            "",
        ]
    if doc.get("error"):
        lines += [f"Run error: `{doc['error'][:500]}`", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--title", default="GLM-5-shaped NVFP4 checkpoint, one H200: serving sweep")
    ap.add_argument("--png", default=None, help="also write the sweep plot here")
    a = ap.parse_args()
    doc = json.loads(Path(a.results).read_text())
    print(report(doc, a.title))
    runs = [e["bench"] for e in doc["phases"].get("sweep", [])]
    if a.png and runs:
        from nsaserve.bench.plot import matplotlib_available, plot_sweep

        if matplotlib_available():
            plot_sweep(runs, a.png, doc["command"])
        else:
            print("matplotlib is not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
