"""A model directory shaped like GLM-5's, for serving with the scripted executor (no weights).

The tokenizer is the embedded model's byte-level BPE plus GLM's markup as added tokens: the
reasoning and tool-call tags are not special (decoding keeps them, as GLM's tokenizer does) and
`<|observation|>`, which ends a turn that called tools, is special and a stop token, as in
GLM-5's generation config. The chat template follows GLM-5's structure: `[gMASK]<sop>`, the tools
as JSON lines in a system turn, `<|role|>` tags without newlines, assistant turns with their
`<think>` part and `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`
calls, tool results as `<tool_response>` blocks after one `<|observation|>`, and a generation
prompt that opens `<think>` (or closes it when `enable_thinking` is false).
"""

from __future__ import annotations

import json
from pathlib import Path

from nsaserve.serve import EMBEDDED_MODEL

MARKUP = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
]
OBSERVATION = "<|observation|>"

# Whitespace is explicit ({%- -%} everywhere, newlines as strings) so Jinja2 (Hugging Face) and
# the router's minijinja render the same text.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\n\\nFor each function call, output the function name and arguments within the following XML format:\\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '<|system|>' + m.content -}}"
    "{%- elif m.role == 'user' -%}{{- '<|user|>' + m.content -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|assistant|>' -}}"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content -%}"
    "{{- '<think>' + m.reasoning_content.strip() + '</think>' -}}"
    "{%- else -%}{{- '</think>' -}}{%- endif -%}"
    "{%- if m.content -%}{{- m.content.strip() -}}{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- set f = tc.function if tc.function else tc -%}"
    "{{- '<tool_call>' + f.name -}}"
    "{%- for k, v in f.arguments.items() -%}"
    "{{- '<arg_key>' + k + '</arg_key><arg_value>' -}}"
    "{%- if v is string -%}{{- v -}}{%- else -%}{{- v | tojson(ensure_ascii=False) -}}{%- endif -%}"
    "{{- '</arg_value>' -}}"
    "{%- endfor -%}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}"
    "{{- '<tool_response>' + m.content + '</tool_response>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '</think>' -}}{%- else -%}{{- '<think>' -}}{%- endif -%}"
    "{%- endif -%}"
)


def added_token(token_id: int, content: str, special: bool) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def write_glm_model_dir(path: Path) -> Path:
    """Writes tokenizer.json, tokenizer_config.json, config.json and generation_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads((EMBEDDED_MODEL / "tokenizer.json").read_text())
    next_id = 1 + max(max(tokenizer["model"]["vocab"].values()), max(t["id"] for t in tokenizer["added_tokens"]))
    for content in MARKUP:
        tokenizer["added_tokens"].append(added_token(next_id, content, special=False))
        next_id += 1
    observation_id = next_id
    tokenizer["added_tokens"].append(added_token(observation_id, OBSERVATION, special=True))
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))

    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    eos = [specials["<|endoftext|>"], specials["<|user|>"], observation_id]
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    config["vocab_size"] = -(-(observation_id + 1) // 64) * 64
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    tokenizer_config = {
        "bos_token": "<sop>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


# A weather tool's parameters (as JSON Schema), and a call to it in GLM-5's markup.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
WEATHER_CALL = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)
