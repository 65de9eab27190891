"""A TEST-ONLY executor whose output is written in a script: end-to-end tests of what the router
does with a model's output (reasoning and tool-call parsing, streaming, stop tokens, max_tokens,
logprobs) need the whole server to emit chosen text, which no real model does on demand.

It is reachable only when a worker is started with `--model-executor null` *and* the environment
variable `NSASERVE_TEST_SCRIPT` names a script file; production never sets both. The worker says
so on stderr and reports the model id "scripted" in its hello, so the server's banner shows it.

The script (JSON, re-read whenever it changes, so a test can add entries to a running server):

    {"record": "/path/prompts.jsonl",                  # optional: one JSON line per request
     "replies": [{"marker": "case-7",                   # chosen when this text is in the prompt
                  "text": "Hmm.</think>Hi<|observation|>"},   # or "ids": [token ids]
                 ...]}

Each new request is matched against the replies by its prompt, decoded with the model
directory's tokenizer.json: the reply whose marker occurs latest in the prompt wins (so in a
multi-turn conversation the newest turn decides). Its tokens are emitted one per step, then the
model's first EOS id forever. No match fails the request with a readable error.

The tokens go through the real sampler: each sampling row's logits are a flat distribution with
the scripted token raised by `MARGIN`, and `sample` runs with the request's own temperature,
penalties, seeds and top logprobs, so the sampling result path is the production one. The
executor keeps a copy of every KV slot's token (written from each plan's `out_slots`), so a
request's prompt is read back through its page table exactly as the attention would read it,
radix-cache hits and chunked prefills included.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..protocol.messages import Plan, StepResult
from .penalty_history import PenaltyHistories
from .sampler import SamplingBatch, sample
from .sampling_results import sampled_entries

SCRIPT_ENV = "NSASERVE_TEST_SCRIPT"
# exp(-50) per competing token: no temperature or penalty a test uses gets another token drawn.
MARGIN = 50.0
# Requests remembered (prompt length and reply); old ones are forgotten first.
MAX_TRACKED = 4096


@dataclass
class Assignment:
    prompt_len: int
    reply: list[int]


class ScriptedExecutor:
    def __init__(
        self, *, script_path: str, model_path: str, vocab_size: int, num_pages: int, page_size: int, max_context: int
    ):
        from tokenizers import Tokenizer  # a test dependency (with transformers), not a serving one

        self.model_id = "scripted"
        self.vocab_size = vocab_size
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_context = max_context
        self.script_path = script_path
        self.tokenizer = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        self.eos = first_eos_id(model_path)
        self.slot_tokens = np.full(num_pages * page_size, -1, dtype=np.int32)
        self.requests: OrderedDict[int, Assignment] = OrderedDict()
        self._script: dict = {}
        self.histories = PenaltyHistories()
        self._script_version: tuple = ()

    def run(self, plan: Plan, is_rank0: bool) -> StepResult:
        t0 = time.perf_counter()
        self.slot_tokens[plan.out_slots] = plan.input_ids
        result = StepResult(step=plan.step)
        # There is no model to score a prompt: requests asking for prompt logprobs fail.
        no_model = plan.prompt_logprobs.astype(bool)
        result.errors += [
            (int(r), "scripted executor: no prompt logprobs without a model") for r in plan.req_ids[no_model]
        ]
        whole, history_errors = self.histories.resolve(plan) if is_rank0 else (plan, [])
        result.errors += history_errors
        failed = {r for r, _ in history_errors}
        targets: dict[int, int] = {}  # request index -> the token its script says comes next
        for i in np.flatnonzero(plan.sample.astype(bool) & ~no_model):
            rid = int(plan.req_ids[i])
            try:
                targets[int(i)] = self._next_token(plan, int(i))
            except LookupError as e:
                result.errors.append((rid, f"scripted executor: {e}"))
        if targets and is_rank0:
            keep = np.zeros(plan.num_reqs, dtype=np.uint8)
            keep[list(targets)] = 1
            sub = replace(whole, sample=keep)
            sb = SamplingBatch.from_plan(sub, "cpu")
            logits = torch.zeros((sb.num_rows, self.vocab_size), dtype=torch.float32)
            order = np.flatnonzero(keep)  # sampling rows follow plan order
            logits[torch.arange(len(order)), torch.tensor([targets[int(i)] for i in order])] = MARGIN
            result.sampled = [e for e in sampled_entries(sub, sb, sample(logits, sb)) if e[0] not in failed]
        result.forward_ms = (time.perf_counter() - t0) * 1e3
        return result

    def _next_token(self, plan: Plan, i: int) -> int:
        rid = int(plan.req_ids[i])
        seq_len = int(plan.cached_lens[i]) + int(plan.query_start[i + 1] - plan.query_start[i])
        got = self.requests.get(rid)
        if got is None:
            prompt = self._context(plan, i, seq_len)
            got = Assignment(prompt_len=seq_len, reply=self._reply_for(rid, prompt))
            self.requests[rid] = got
            while len(self.requests) > MAX_TRACKED:
                self.requests.popitem(last=False)
        k = seq_len - got.prompt_len
        return got.reply[k] if k < len(got.reply) else self.eos

    def _context(self, plan: Plan, i: int, seq_len: int) -> list[int]:
        """The request's tokens at positions 0..seq_len-1, read through its page table."""
        pages = plan.page_table[plan.page_start[i] : plan.page_start[i + 1]].astype(np.int64)
        pos = np.arange(seq_len)
        return self.slot_tokens[pages[pos // self.page_size] * self.page_size + pos % self.page_size].tolist()

    def _reply_for(self, rid: int, prompt: list[int]) -> list[int]:
        script = self._load_script()
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        best, best_at = None, -1
        for entry in script.get("replies", []):
            at = text.rfind(entry["marker"])
            if at > best_at:
                best, best_at = entry, at
        if best is None:
            raise LookupError(f"no script entry's marker is in the prompt (script {self.script_path})")
        reply = (
            list(best["ids"]) if "ids" in best else self.tokenizer.encode(best["text"], add_special_tokens=False).ids
        )
        if script.get("record"):
            line = {
                "req_id": rid,
                "marker": best["marker"],
                "prompt_ids": prompt,
                "prompt_text": text,
                "reply_ids": reply,
            }
            with open(script["record"], "a") as f:
                f.write(json.dumps(line) + "\n")
        return reply

    def _load_script(self) -> dict:
        st = os.stat(self.script_path)
        version = (st.st_ino, st.st_mtime_ns, st.st_size)  # tests replace the file atomically
        if version != self._script_version:
            with open(self.script_path) as f:
                self._script = json.load(f)
            self._script_version = version
        return self._script


def first_eos_id(model_path: str) -> int:
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_path, name)
        if os.path.exists(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return int(eos[0] if isinstance(eos, list) else eos)
    raise ValueError(f"{model_path} names no eos_token_id")


def scripted_executor(args) -> ScriptedExecutor:
    """The worker's executor when the test environment names a script (see the module doc)."""
    script = os.environ[SCRIPT_ENV]
    print(f"[nsaserve worker] TEST ONLY: scripted executor reading {script}", file=sys.stderr, flush=True)
    from .main import model_vocab_size

    return ScriptedExecutor(
        script_path=script,
        model_path=args.model_path,
        vocab_size=model_vocab_size(args.model_path),
        num_pages=args.num_pages or 4096,
        page_size=args.page_size,
        max_context=args.max_context or 4096,
    )
