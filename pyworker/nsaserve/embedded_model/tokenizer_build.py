"""Builds the embedded model's tokenizer: a small byte-level BPE plus GLM-style special tokens and chat template.

Byte-level means every string encodes (unknown words fall back to byte tokens), so arbitrary prompts work even
though the merges are learned mostly from the Zen. No post-processor: like GLM, encoding plain text adds no BOS;
the chat template writes `[gMASK]<sop>` itself.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .corpus import ASSISTANT, EOS, SOP, SPECIAL_TOKENS, USER, filler_text, zen_text

VOCAB_SIZE = 640
# The Zen dominates the merge statistics so its words become single tokens (short recital, easy to memorise);
# the filler adds common English pieces so other prompts do not collapse into single bytes.
ZEN_WEIGHT = 8

# GLM-like: `[gMASK]<sop>` once, then `<|role|>\n` + content per message. One line, no whitespace control and
# no Python string methods, so any Jinja engine (with or without trim_blocks/lstrip_blocks) renders the same
# string. Content may be a string or a list of OpenAI-style parts, of which the text parts are used.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [zen_text()] * ZEN_WEIGHT + filler_text().splitlines()
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def build_hf_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(),
        bos_token=SOP,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """EOS ends every answer; `<|user|>` (a new turn) and `<|assistant|>` also stop a chat, as in GLM."""
    return [tokenizer.convert_tokens_to_ids(t) for t in (EOS, USER, ASSISTANT)]
