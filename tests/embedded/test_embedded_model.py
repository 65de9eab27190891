"""The shipped default model loads in transformers and recites the Zen of Python exactly, robustly.

These are also the properties the end-to-end server tests rely on: exact greedy recital (completion and chat),
wide logit margins, a sparse top-k selection that is really active and really matters, and identical output
with and without a KV cache.
"""

import json
import random

import pytest
import torch
from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

from nsaserve.embedded_model import MODEL_DIR
from nsaserve.embedded_model.corpus import EOS, line_starts, zen_from_stdlib, zen_text

HF_FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
]
MAX_TOTAL_BYTES = 4 * 1024 * 1024
MIN_MARGIN = 8.0  # logits; training targets 12, and bf16 / FP8 KV rounding moves logits by well under 1
PROMPT = "Beautiful is better than"


@pytest.fixture(scope="module", autouse=True)
def few_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    return GlmMoeDsaForCausalLM.from_pretrained(MODEL_DIR).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def greedy(model, prompts: list[list[int]], pad_id: int, **kwargs):
    """Greedy generation with transformers' KV cache, the prompts batched (left-padded, as generate expects)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return model.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=260, pad_token_id=pad_id, **kwargs
    )


def new_tokens(row: torch.Tensor, prompt_width: int, eos_id: int) -> list[int]:
    """The generated part of one output row, up to and including its first EOS (rows finish at different steps)."""
    tokens = row[prompt_width:].tolist()
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def continuation_of(text: str, prompt: str) -> str:
    assert prompt in text
    return text[text.index(prompt) + len(prompt) :]


def margins(model, tokenizer, prompt_ids: list[int], continuation: str) -> torch.Tensor:
    """Per generated position: logit of the expected token minus the best other logit (teacher forced)."""
    target = tokenizer.encode(continuation, add_special_tokens=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + target])).logits[0, len(prompt_ids) - 1 : -1]
    target = torch.tensor(target)
    expected = logits.gather(-1, target[:, None]).squeeze(-1)
    others = logits.scatter(-1, target[:, None], float("-inf")).amax(-1)
    return expected - others


def test_directory_is_a_small_hf_model():
    sizes = {name: (MODEL_DIR / name).stat().st_size for name in HF_FILES}
    print(f"\nmodel files: {sizes}, total {sum(sizes.values())} bytes")
    assert sum(sizes.values()) <= MAX_TOTAL_BYTES
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa"
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"]
    tokenizer_config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"].startswith("[gMASK]<sop>")
    assert tokenizer_config["eos_token"] == EOS


def test_data_file_is_the_stdlib_zen():
    assert zen_text() == zen_from_stdlib()


def test_tokenizer_encodes_any_text(tokenizer):
    text = "Grüße, 世界! def f(x): return x ** 2  # tabs\tand\nnewlines"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


def test_architecture_exercises_sparse_attention_and_moe(model, tokenizer):
    config = model.config
    recital_tokens = len(tokenizer.encode(zen_text(), add_special_tokens=False))
    print(f"\nrecital {recital_tokens} tokens, index_topk {config.index_topk}")
    assert config.index_topk < recital_tokens
    assert config.index_n_heads >= 16
    assert "sparse" in config.mlp_layer_types and "dense" in config.mlp_layer_types
    assert config.num_experts_per_tok >= 2 and config.n_routed_experts > config.num_experts_per_tok


@pytest.fixture(scope="module")
def completion(model, tokenizer):
    """The newcomer's request: greedy from "Beautiful is better than", keeping each step's logits."""
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    return prompt_ids, greedy(
        model, [prompt_ids], tokenizer.pad_token_id, return_dict_in_generate=True, output_logits=True
    )


def test_completion_recites_to_the_end(completion, tokenizer):
    prompt_ids, output = completion
    generated = output.sequences[0, len(prompt_ids) :].tolist()
    assert generated[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(generated[:-1]) == continuation_of(zen_text(), PROMPT)


def test_chat_recites(model, tokenizer):
    messages = [{"role": "user", "content": "Recite the Zen of Python."}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    prompt_text = tokenizer.decode(prompt_ids)
    assert prompt_text == "[gMASK]<sop><|user|>\nRecite the Zen of Python.<|assistant|>\n"
    generated = greedy(model, [prompt_ids], tokenizer.pad_token_id)[0, len(prompt_ids) :].tolist()
    assert generated[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(generated[:-1]) == zen_text()


def test_chat_with_system_message_recites(model, tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Recite the Zen of Python."}]},
    ]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert margins(model, tokenizer, prompt_ids, zen_text() + EOS).min() > MIN_MARGIN


def test_completion_from_other_lines(model, tokenizer):
    text = zen_text()
    starts = random.Random(7).sample([s for s in line_starts(text) if not text[s:].startswith(PROMPT)], 3)
    prompts = [" ".join(text[start:].split(" ")[:2]) for start in starts]
    prompt_ids = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts]
    output = greedy(model, prompt_ids, tokenizer.pad_token_id)
    width = max(len(p) for p in prompt_ids)
    for row, start, prompt in zip(output, starts, prompts):
        generated = new_tokens(row, width, tokenizer.eos_token_id)
        assert generated[-1] == tokenizer.eos_token_id, prompt
        assert tokenizer.decode(generated[:-1]) == text[start + len(prompt) :], prompt


def test_logit_margins_are_wide(model, tokenizer):
    text = zen_text()
    completion = margins(model, tokenizer, tokenizer.encode(PROMPT), continuation_of(text, PROMPT) + EOS)
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Recite the Zen of Python."}], add_generation_prompt=True, return_dict=False
    )
    chat = margins(model, tokenizer, chat_ids, text + EOS)
    print(f"\nmin top-1 vs top-2 margin: completion {completion.min():.2f}, chat {chat.min():.2f}")
    assert completion.min() > MIN_MARGIN
    assert chat.min() > MIN_MARGIN


def test_cached_and_uncached_decoding_agree(model, completion):
    """Decoding with transformers' KV cache (the indexer scoring one new query against cached keys) gives the
    logits of a full uncached forward pass over the same tokens: same argmax everywhere, and close values.
    With few indexer heads, ReLU would zero many scores and top-k would choose among ties differently."""
    prompt_ids, output = completion
    cached = torch.cat(output.logits)  # [new tokens, vocab], one decode step each
    with torch.no_grad():
        uncached = model(input_ids=output.sequences, use_cache=False).logits[0, len(prompt_ids) - 1 : -1]
    assert cached.shape[0] > model.config.index_topk
    assert torch.equal(cached.argmax(-1), uncached.argmax(-1))
    assert (cached - uncached).abs().max() < 1e-3  # a different top-k choice moves logits by far more


def test_sparse_selection_matters(model, tokenizer):
    """Inverting the indexer (it then keeps the least relevant tokens) must break the recital: the top-k
    selection is load-bearing, so a server that selects the wrong tokens fails the recital."""
    text = zen_text()
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    weights = [layer.self_attn.indexer.weights_proj.weight for layer in model.model.layers]
    originals = [w.detach().clone() for w in weights]
    try:
        with torch.no_grad():
            for w in weights:
                w.neg_()
        broken = margins(model, tokenizer, prompt_ids, continuation_of(text, PROMPT) + EOS)
    finally:
        with torch.no_grad():
            for w, original in zip(weights, originals):
                w.copy_(original)
    assert (broken <= 0).any()


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """e4m3 rounding with one scale per vector (amax / 448), as an FP8 KV cache stores a token's latent."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recital_survives_bf16_and_fp8_kv_rounding(tokenizer, dtype):
    """Serving numerics: bf16 weights/activations, and FP8-rounded MLA latents and indexer keys (what an FP8
    KV cache holds) keep every recital token the argmax, with a wide margin."""
    model = GlmMoeDsaForCausalLM.from_pretrained(MODEL_DIR, dtype=dtype).eval()
    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm.register_forward_hook(lambda module, args, out: fp8_round(out))
        layer.self_attn.indexer.k_norm.register_forward_hook(lambda module, args, out: fp8_round(out))
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    low_precision = margins(model, tokenizer, prompt_ids, continuation_of(zen_text(), PROMPT) + EOS)
    print(f"\nmin margin with {dtype} and FP8-rounded latents: {low_precision.min():.2f}")
    assert low_precision.min() > MIN_MARGIN


def test_moe_routing_matters(model, tokenizer):
    """Every routed expert serves some recital tokens, and rotating the experts' weights (each token then
    gets other experts) breaks the recital: a server must route tokens to the right experts to reproduce it."""
    moe = model.model.layers[-1].mlp
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Recite the Zen of Python."}], add_generation_prompt=True, return_dict=False
    )
    ids = chat_ids + tokenizer.encode(zen_text() + EOS, add_special_tokens=False)
    routed = []
    handle = moe.gate.register_forward_hook(lambda module, args, out: routed.append(out[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    handle.remove()
    counts = torch.bincount(routed[0].flatten(), minlength=moe.experts.num_experts)
    print(f"\ntokens per routed expert: {counts.tolist()}")
    assert (counts > 0).all()

    order = [(e + 1) % moe.experts.num_experts for e in range(moe.experts.num_experts)]
    originals = {name: p.detach().clone() for name, p in moe.experts.named_parameters()}
    try:
        with torch.no_grad():
            for name, p in moe.experts.named_parameters():
                p.copy_(originals[name][order])
        swapped = margins(model, tokenizer, chat_ids, zen_text() + EOS)
    finally:
        with torch.no_grad():
            for name, p in moe.experts.named_parameters():
                p.copy_(originals[name])
    assert (swapped <= 0).any()
