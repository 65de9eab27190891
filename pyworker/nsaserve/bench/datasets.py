"""Benchmark datasets: random prompts, and multi-turn conversations behind one shared system prompt.

Everything is drawn from a numpy Generator seeded by the caller, so a seed fixes every prompt and
every length. A prompt is either token ids (exact lengths; sent as a token-id prompt to
/v1/completions) or random words (for chat, or servers without token-id prompts; the server's
tokenizer decides the exact length, which the runner then reads from the response's usage).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Common English words: most are one token with a leading space in BPE vocabularies, so a
# prompt of n words is close to n tokens.
WORDS = (
    "the of and to in is was for on are as with his they at be this from have or by one had not but what all were "
    "when we there can an your which their said if do will each about how up out them then she many some so these "
    "would other into has more her two like him see time could no make than first been its who now people my made "
    "over did down only way find use may water long little very after words called just where most know get through "
    "back much before go good new write our used me man too any day same right look think also around another came "
    "come work three word must because does part even place well such here take why things help put years different "
    "away again off went old number great tell men say small every found still between name should home big give air "
    "line set own under read last never us left end along while might next sound below saw something thought both few"
).split()


@dataclass
class Turn:
    """One request. `prompt` is the whole /v1/completions prompt (ids or text); `messages` is the
    same conversation for /v1/chat/completions (text prompts only, else None). `prompt_len` is
    the dataset's intended length in tokens (exact for ids; chat templates add a few more)."""

    prompt: list[int] | str
    messages: list[dict] | None
    prompt_len: int
    output_len: int


@dataclass
class Conversation:
    """Turns sent one after another: a turn goes out when the previous one has finished."""

    turns: list[Turn] = field(default_factory=list)


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> np.ndarray:
    """sglang's definition: uniform integers in [max(1, floor(ratio * length)), length].
    Ratio 0 (sglang's default) gives a mean of about length / 2; ratio 1 gives exactly `length`."""
    if length < 1:
        raise ValueError(f"length must be at least 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return rng.integers(low, length + 1, size=n)


class Content:
    """Random prompt material of a requested length: token ids below `vocab_size`, or words
    when `vocab_size` is None."""

    def __init__(self, rng: np.random.Generator, vocab_size: int | None):
        if vocab_size is not None and vocab_size < 2:
            raise ValueError(f"vocab size must be at least 2, got {vocab_size}")
        self.rng = rng
        self.vocab_size = vocab_size

    @property
    def is_text(self) -> bool:
        return self.vocab_size is None

    def make(self, n: int) -> list[int] | str:
        if self.vocab_size is None:
            return " ".join(WORDS[i] for i in self.rng.integers(0, len(WORDS), size=n))
        return self.rng.integers(0, self.vocab_size, size=n).tolist()


def _join(parts: list[list[int] | str]) -> list[int] | str:
    """Concatenate segments so that every prefix of the part list gives a prefix of the result."""
    if parts and isinstance(parts[0], str):
        return "".join(p + "\n\n" for p in parts[:-1]) + parts[-1]
    return [t for p in parts for t in p]


def random_dataset(
    rng: np.random.Generator,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int | None,
) -> list[Conversation]:
    """`num_prompts` single-turn requests with sglang-style random lengths."""
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    content = Content(rng, vocab_size)
    out = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        prompt = content.make(n_in)
        messages = [{"role": "user", "content": prompt}] if content.is_text else None
        out.append(Conversation([Turn(prompt, messages, n_in, n_out)]))
    return out


def shared_prefix_dataset(
    rng: np.random.Generator,
    num_conversations: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    num_turns: int,
    vocab_size: int | None,
) -> list[Conversation]:
    """Conversations that all start with one system prompt; turn k's prompt is the system prompt,
    the previous k-1 questions and replies, then question k. So a server with a prefix cache can
    reuse the system prompt across conversations and each previous turn within one.

    The replies in the history are the dataset's own fixed random replies of `output_len` tokens,
    not what the server said: runs are reproducible and do not depend on the model's output (the
    server's cache can still reuse everything up to the end of the previous turn's prompt)."""
    if num_turns < 1:
        raise ValueError(f"turns must be at least 1, got {num_turns}")
    content = Content(rng, vocab_size)
    system = content.make(system_prompt_len)
    out = []
    for _ in range(num_conversations):
        parts: list[list[int] | str] = [system]
        messages = [{"role": "system", "content": system}] if content.is_text else None
        conv = Conversation()
        for k in range(num_turns):
            if k > 0:
                reply = content.make(output_len)
                parts.append(reply)
                if messages is not None:
                    messages.append({"role": "assistant", "content": reply})
            question = content.make(question_len)
            parts.append(question)
            if messages is not None:
                messages.append({"role": "user", "content": question})
            prompt_len = system_prompt_len + (k + 1) * question_len + k * output_len
            conv.turns.append(Turn(_join(parts), None if messages is None else list(messages), prompt_len, output_len))
        out.append(conv)
    return out


def warmup_dataset(rng: np.random.Generator, first: Turn, n: int, vocab_size: int | None) -> list[Conversation]:
    """`n` fresh requests shaped like `first` (same lengths), with their own random content so
    that warm-up does not put any measured prompt into the server's prefix cache."""
    content = Content(rng, vocab_size)
    out = []
    for _ in range(n):
        prompt = content.make(first.prompt_len)
        messages = [{"role": "user", "content": prompt}] if content.is_text else None
        out.append(Conversation([Turn(prompt, messages, first.prompt_len, first.output_len)]))
    return out
