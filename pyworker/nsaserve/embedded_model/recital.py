"""Checks that a model recites: teacher-forced argmax over the expected continuation and its logit margins.

With a causal model (the indexer masks future keys too) the logits at each position depend only on the tokens
before it, so "the argmax equals the next expected token at every position" is exactly "greedy decoding
reproduces the continuation". One forward pass checks a whole recital.
"""

from dataclasses import dataclass

import torch

from .corpus import EOS, chat_prompt, line_starts, zen_text


@dataclass
class RecitalCheck:
    name: str
    exact: bool
    min_margin: float  # smallest (expected logit - best other logit) over the continuation
    first_error: int | None  # index into the continuation of the first wrong argmax


def recital_cases() -> list[tuple[str, str, str]]:
    """(name, prompt, expected continuation incl. EOS): chat, and a completion from every line start."""
    text = zen_text()
    cases = [("chat", chat_prompt("Recite the Zen of Python.", None), text + EOS)]
    for start in line_starts(text):
        end = text.index("\n", start) if "\n" in text[start:] else len(text)
        # The prompt is the line without its last word, as a user would type "Beautiful is better than".
        cut = text.rindex(" ", start, end) if " " in text[start:end] else end
        cases.append((f"line@{start}", text[start:cut], text[cut:] + EOS))
    return cases


@torch.no_grad()
def check_recital(model, tokenizer, name: str, prompt: str, continuation: str) -> RecitalCheck:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    target_ids = tokenizer.encode(continuation, add_special_tokens=False)
    ids = torch.tensor([prompt_ids + target_ids])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()
    target = torch.tensor(target_ids)
    expected = logits.gather(-1, target[:, None]).squeeze(-1)
    others = logits.scatter(-1, target[:, None], float("-inf")).amax(-1)
    margins = expected - others
    wrong = (margins <= 0).nonzero()
    first_error = int(wrong[0]) if len(wrong) else None
    return RecitalCheck(name, first_error is None, float(margins.min()), first_error)


def check_all(model, tokenizer) -> list[RecitalCheck]:
    return [check_recital(model, tokenizer, *case) for case in recital_cases()]
