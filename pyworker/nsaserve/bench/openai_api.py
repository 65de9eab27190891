"""One benchmark request against an OpenAI-compatible server: the request body for
/v1/completions or /v1/chat/completions, and the timing of its response."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

from .client import HttpClient, HttpError, ProtocolError
from .datasets import Turn
from .metrics import RequestResult

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class ApiOptions:
    model: str
    chat: bool = False
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    timeout_s: float | None = None

    @property
    def path(self) -> str:
        return CHAT if self.chat else COMPLETIONS


def request_body(opts: ApiOptions, turn: Turn) -> dict:
    if opts.chat:
        if turn.messages is None:
            raise ValueError("chat requests need text prompts, not token ids")
        body: dict = {"model": opts.model, "messages": turn.messages}
    else:
        body = {"model": opts.model, "prompt": turn.prompt}
    # max_tokens with ignore_eos makes every output exactly output_len tokens long.
    body.update(max_tokens=turn.output_len, temperature=opts.temperature, stream=opts.stream)
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.stream:
        # The final usage chunk gives the server's own token counts.
        body["stream_options"] = {"include_usage": True}
    body.update(opts.extra_body)
    return body


def _choice_text(obj: dict, part: str) -> str:
    """The first choice's generated text: completions' `text`, or chat's content and reasoning
    under `part` ("delta" in a streamed chunk, "message" in a whole response)."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    inner = c.get(part) or {}
    return (inner.get("content") or "") + (inner.get("reasoning_content") or "")


def chunk_text(obj: dict) -> str:
    """The generated text of a streamed chunk."""
    return _choice_text(obj, "delta")


def finished(obj: dict) -> bool:
    choices = obj.get("choices") or []
    return bool(choices and choices[0].get("finish_reason"))


def response_text(obj: dict) -> str:
    """The generated text of a whole (non-streamed) response."""
    return _choice_text(obj, "message")


class StreamFailed(Exception):
    """The server reported an error inside the stream, or the stream was malformed."""


def _error_message(obj: dict) -> str:
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def _streamed(client: HttpClient, opts: ApiOptions, body: dict, turn: Turn, sent: float) -> RequestResult:
    first = last = finish = None
    itl: list[float] = []
    chunks = 0
    usage = None
    done = False
    async with contextlib.aclosing(client.post_sse(opts.path, body)) as events:
        async for event in events:
            if event.data.strip() == "[DONE]":
                done = True
                continue
            try:
                obj = json.loads(event.data)
            except json.JSONDecodeError as e:
                raise StreamFailed(f"bad JSON in stream: {event.data[:200]!r}") from e
            if "error" in obj:
                raise StreamFailed(_error_message(obj))
            if obj.get("usage"):
                usage = obj["usage"]
            if finish is None and finished(obj):
                finish = event.arrived
            if chunk_text(obj):
                if first is None:
                    first = event.arrived
                else:
                    itl.append(event.arrived - last)
                last = event.arrived
                chunks += 1
    end = time.perf_counter()
    if not done:
        raise StreamFailed("the stream ended without [DONE]")
    if first is None:
        # Tokens whose text is empty (special tokens, bytes of an unfinished character) show no
        # text at all; if the server counts tokens, the request still succeeded, and the first
        # sign of output is the chunk that finished it.
        if not (usage and usage.get("completion_tokens") and finish is not None):
            raise StreamFailed("the response had no generated text")
        first = finish
    return RequestResult(
        ok=True,
        prompt_tokens=int(usage["prompt_tokens"]) if usage else turn.prompt_len,
        output_tokens=int(usage["completion_tokens"]) if usage else chunks,
        ttft=first - sent,
        itl=itl,
        latency=end - sent,
    )


async def _whole(client: HttpClient, opts: ApiOptions, body: dict, turn: Turn, sent: float) -> RequestResult:
    obj = await client.post_json(opts.path, body)
    end = time.perf_counter()
    if not isinstance(obj, dict) or "error" in obj:
        raise StreamFailed(_error_message(obj) if isinstance(obj, dict) else f"unexpected response {obj!r:.200}")
    usage = obj.get("usage") or {}
    if not (response_text(obj) or usage.get("completion_tokens")):
        raise StreamFailed("the response had no generated text")
    # Without streaming the first token arrives with the last one.
    return RequestResult(
        ok=True,
        prompt_tokens=int(usage.get("prompt_tokens", turn.prompt_len)),
        output_tokens=int(usage.get("completion_tokens", turn.output_len)),
        ttft=end - sent,
        latency=end - sent,
    )


async def send(client: HttpClient, opts: ApiOptions, turn: Turn) -> RequestResult:
    """Send one request; every failure becomes a failed result carrying its message."""
    body = request_body(opts, turn)
    sent = time.perf_counter()
    run = _streamed if opts.stream else _whole
    try:
        return await asyncio.wait_for(run(client, opts, body, turn, sent), opts.timeout_s)
    except HttpError as e:
        message = e.body
        with contextlib.suppress(ValueError, AttributeError):
            message = _error_message(json.loads(e.body))
        return RequestResult(ok=False, latency=time.perf_counter() - sent, error=f"HTTP {e.status}: {message}"[:500])
    except TimeoutError:
        # Either --request-timeout or the client's connect timeout.
        what = f"after {opts.timeout_s} s" if opts.timeout_s else "connecting"
        return RequestResult(ok=False, latency=time.perf_counter() - sent, error=f"timed out {what}")
    except (StreamFailed, ProtocolError, OSError, ValueError) as e:
        return RequestResult(ok=False, latency=time.perf_counter() - sent, error=f"{type(e).__name__}: {e}"[:500])
