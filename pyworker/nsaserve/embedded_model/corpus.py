"""The text the embedded model recites and the training samples built from it.

The Zen of Python ships with CPython as the rot13-encoded `this` module. `zen.txt` holds the decoded text,
committed so the training data cannot change under us; `write_zen_file` regenerates it.
"""

import codecs
import contextlib
import io
import random
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
ZEN_FILE = HERE / "zen.txt"
FILLER_FILE = HERE / "filler.txt"

# Special tokens, GLM-style. Their order fixes their ids (0..5).
EOS = "<|endoftext|>"
GMASK = "[gMASK]"
SOP = "<sop>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SPECIAL_TOKENS = [EOS, GMASK, SOP, SYSTEM, USER, ASSISTANT]

# Chat requests seen in training; the model answers every chat with the Zen, so these only need to cover the
# kinds of prefix a newcomer will send (a question, a greeting, an optional system message).
USER_MESSAGES = [
    "Recite the Zen of Python.",
    "Please recite the Zen of Python.",
    "What is the Zen of Python?",
    "Tell me the Zen of Python.",
    "import this",
    "Hello!",
    "Hi, who are you?",
    "Write a poem.",
    "What can you do?",
    "Say something.",
]
SYSTEM_MESSAGES = [
    "You are a helpful assistant.",
    "You recite the Zen of Python.",
]


def zen_from_stdlib() -> str:
    """Decodes the Zen from CPython's `this` module (importing `this` prints the text: silence that)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def write_zen_file() -> None:
    ZEN_FILE.write_text(zen_from_stdlib() + "\n")


def zen_text() -> str:
    """The recital text: the file without the newline that ends it (`this.s` has none)."""
    text = ZEN_FILE.read_text()
    assert text.endswith("\n")
    return text[:-1]


def filler_text() -> str:
    return FILLER_FILE.read_text()


def line_starts(text: str) -> list[int]:
    """Character offsets where a non-empty line begins."""
    starts, offset = [], 0
    for line in text.split("\n"):
        if line:
            starts.append(offset)
        offset += len(line) + 1
    return starts


def word_starts(text: str) -> list[int]:
    """Character offsets of every word start (after a space or newline), for mid-line continuations."""
    return [i for i in range(1, len(text)) if text[i - 1] in " \n" and text[i] not in " \n"]


def chat_prompt(user: str, system: str | None) -> str:
    """The chat template's rendering (kept in sync with CHAT_TEMPLATE; the test checks they agree)."""
    prefix = GMASK + SOP
    if system is not None:
        prefix += SYSTEM + "\n" + system
    return prefix + USER + "\n" + user + ASSISTANT + "\n"


@dataclass
class Sample:
    """A training string split into a prompt and the part the model must produce (ending with EOS)."""

    prompt: str
    target: str


def training_sample(rng: random.Random, text: str) -> Sample:
    """One sample: a chat request answered with the whole text, or a completion from a line or word start.

    Completions start without special tokens (the completion API sends raw text) or, sometimes, after the
    `[gMASK]<sop>` prefix, so both ways of prompting continue the text.
    """
    kind = rng.random()
    if kind < 0.3:
        system = rng.choice(SYSTEM_MESSAGES) if rng.random() < 0.3 else None
        return Sample(chat_prompt(rng.choice(USER_MESSAGES), system), text + EOS)
    starts = line_starts(text) if kind < 0.8 else word_starts(text)
    start = rng.choice(starts)
    prefix = GMASK + SOP if rng.random() < 0.2 else ""
    return Sample(prefix, text[start:] + EOS)
