"""The HTTP/SSE client and one request's timing, against a fake server written here: a tiny asyncio
HTTP/1.1 server that answers /v1/completions as the request body's "model" asks."""

from __future__ import annotations

import asyncio
import json

import pytest

from nsaserve.bench.client import HttpClient, SseParser
from nsaserve.bench.datasets import Conversation, Turn
from nsaserve.bench.openai_api import ApiOptions, send
from nsaserve.bench.runner import run_load


class FakeOpenAI:
    def __init__(self, token_gap_s: float = 0.0, first_token_s: float = 0.0):
        self.token_gap_s = token_gap_s
        self.first_token_s = first_token_s
        self.connections = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeOpenAI:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    keep = await self._answer(method, path, json.loads(body) if body else None, writer)
                finally:
                    self.in_flight -= 1
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    @staticmethod
    def _chunk(data: bytes) -> bytes:
        return f"{len(data):x}\r\n".encode() + data + b"\r\n"

    async def _answer(self, method: str, path: str, body: dict | None, w: asyncio.StreamWriter) -> bool:
        """Write one response; False closes the connection."""
        if path == "/v1/models":
            return self._whole(w, 200, {"object": "list", "data": [{"id": "stream"}]})
        if path == "/metrics":
            return self._whole(w, 404, {"error": "no metrics"})
        self.bodies.append(body)
        mode = body["model"]
        n = body["max_tokens"]
        if mode == "http500":
            return self._whole(w, 500, {"error": {"message": "the engine fell over", "code": 500}})
        if not body.get("stream"):
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            await asyncio.sleep(self.first_token_s)
            return self._whole(w, 200, {"choices": [{"index": 0, "text": "x" * n}], "usage": usage})
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(self._chunk(b": keep-alive comment\n\n"))
        await w.drain()
        await asyncio.sleep(self.first_token_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.token_gap_s)
            if mode == "cut" and i == 2:
                w.close()  # the server dies in the middle of the stream
                return False
            if mode == "inband-error" and i == 1:
                err = {"error": {"message": "generation failed: worker died", "code": 500}}
                w.write(self._chunk(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"))
                w.write(b"0\r\n\r\n")
                return True
            text = "" if mode == "empty-text" else f"t{i}"  # tokens that decode to no text
            finish = "length" if i == n - 1 else None
            choice = {"index": 0, "text": text, "finish_reason": finish}
            event = b"data: " + json.dumps({"choices": [choice]}).encode() + b"\r\n\r\n"
            # Split one event over two chunks: the parser must join them.
            w.write(self._chunk(event[:7]) + self._chunk(event[7:]))
            await w.drain()
        if mode not in ("no-done", "no-usage"):
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
            w.write(self._chunk(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"))
        if mode != "no-done":
            w.write(self._chunk(b"data: [DONE]\n\n"))
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True

    @staticmethod
    def _whole(w: asyncio.StreamWriter, status: int, obj: dict) -> bool:
        data = json.dumps(obj).encode()
        w.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        return True


def turn(output_len: int = 5) -> Turn:
    return Turn(prompt=[1, 2, 3, 4], messages=None, prompt_len=4, output_len=output_len)


def test_sse_parser_joins_split_events_and_skips_comments():
    p = SseParser()
    assert p.feed(b": ping\n\nda", 1.0) == []
    assert p.feed(b"ta: {\"a\"", 2.0) == []
    events = p.feed(b": 1}\r\n\r\ndata:x\ndata: y\n\nevent: z\n\n", 3.0)
    assert [(e.data, e.arrived) for e in events] == [('{"a": 1}', 3.0), ("x\ny", 3.0)]
    assert [e.data for e in p.feed(b"data: [DONE]", 4.0) + p.finish(5.0)] == ["[DONE]"]


def run(coro):
    return asyncio.run(coro)


def test_streaming_request_times_every_token_and_reuses_the_connection():
    async def go():
        async with FakeOpenAI(token_gap_s=0.05, first_token_s=0.1) as server:
            client = HttpClient(server.url)
            opts = ApiOptions(model="stream")
            first = await send(client, opts, turn(5))
            second = await send(client, opts, turn(3))
            await client.close()
            return server, first, second

    server, r, r2 = run(go())
    assert r.ok and r2.ok, (r.error, r2.error)
    assert (r.prompt_tokens, r.output_tokens) == (4, 5)
    assert 0.1 <= r.ttft < 1.0
    assert len(r.itl) == 4 and all(0.045 <= g < 1.0 for g in r.itl)
    assert r.latency >= r.ttft + sum(r.itl) - 1e-6
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 4)
    assert server.connections == 1  # keep-alive: the second request used the same connection
    body = server.bodies[0]
    assert body["prompt"] == [1, 2, 3, 4] and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_non_streaming_request_has_ttft_equal_to_latency():
    async def go():
        async with FakeOpenAI(first_token_s=0.05) as server:
            client = HttpClient(server.url)
            r = await send(client, ApiOptions(model="stream", stream=False), turn(7))
            await client.close()
            return r

    r = run(go())
    assert r.ok and r.output_tokens == 7 and r.ttft == r.latency >= 0.05 and r.itl == []


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("http500", "HTTP 500: the engine fell over"),
        ("inband-error", "generation failed: worker died"),
        ("cut", "closed in the middle"),
        ("no-done", "without [DONE]"),
    ],
)
def test_failures_are_counted_with_their_message(mode, message):
    async def go():
        async with FakeOpenAI() as server:
            client = HttpClient(server.url)
            bad = await send(client, ApiOptions(model=mode), turn(5))
            good = await send(client, ApiOptions(model="stream"), turn(2))  # the client recovers
            await client.close()
            return bad, good

    bad, good = run(go())
    assert not bad.ok and message in bad.error
    assert good.ok and good.output_tokens == 2


def test_a_refused_connection_is_a_failure_not_a_crash():
    async def go():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return await send(HttpClient(f"http://127.0.0.1:{port}"), ApiOptions(model="stream"), turn())

    r = run(go())
    assert not r.ok and "Error" in r.error


def test_max_concurrency_caps_requests_in_flight_and_turns_go_in_order():
    convs = [Conversation([turn(3), turn(2)]) for _ in range(12)]

    async def go():
        async with FakeOpenAI(token_gap_s=0.01) as server:
            client = HttpClient(server.url)
            done = []
            results, duration = await run_load(client, ApiOptions(model="stream"), convs, [0.0] * 12, 3, done.append)
            await client.close()
            return server, results, duration, done

    server, results, duration, done = run(go())
    assert len(results) == 24 and all(r.ok for r in results) and len(done) == 24
    assert server.max_in_flight == 3
    assert server.connections <= 3 + 1  # the pool reuses connections between requests
    assert duration > 0


def test_tokens_without_text_count_when_the_server_reports_them():
    async def go():
        async with FakeOpenAI(token_gap_s=0.02) as server:
            client = HttpClient(server.url)
            counted = await send(client, ApiOptions(model="empty-text"), turn(4))
            without_usage = await send(client, ApiOptions(model="no-usage"), turn(4))
            await client.close()
            return counted, without_usage

    counted, without_usage = run(go())
    # No text at all: the server's usage still says 4 tokens, first seen with the finishing chunk.
    assert counted.ok and counted.output_tokens == 4 and counted.itl == []
    assert 0.06 <= counted.ttft <= counted.latency
    # Without usage the client counts text chunks itself.
    assert without_usage.ok and without_usage.output_tokens == 4 and without_usage.prompt_tokens == 4


def test_request_timeout_is_a_failure_and_frees_the_connection():
    async def go():
        async with FakeOpenAI(first_token_s=1.0) as server:
            client = HttpClient(server.url)
            slow = await send(client, ApiOptions(model="stream", timeout_s=0.2), turn(3))
            await asyncio.sleep(0.05)
            idle = len(client._idle)
            await client.close()
            return slow, idle

    slow, idle = run(go())
    assert not slow.ok and "timed out after 0.2 s" in slow.error and 0.2 <= slow.latency < 1.0
    assert idle == 0  # a half-read response never goes back to the pool
