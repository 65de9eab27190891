"""Disconnect storm: 1,000 streaming completions at once, half of whose clients close the socket
at a random point (before the response, or after some tokens; some with a reset). Afterwards
every KV page is back in the pool, nothing runs or waits, the engine's request counters add up,
and the clients that stayed got exactly the text a lone request gets."""

from __future__ import annotations

import asyncio
import json
import random
import resource
import socket
import struct
import time

import pytest
from server_process import DEVICE_FLAG

from nsaserve.serve import EMBEDDED_MODEL

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")

CLIENTS = 1000
MAX_TOKENS = 6
PROMPTS = [
    "Beautiful is better than",
    "Beautiful is better than ugly.\nExplicit is better than",
    "Simple is better than",
    "Simple is better than complex.\nComplex is better than",
    "Errors should never",
    "Now is better than",
    "Namespaces are one honking great idea",
    "In the face of ambiguity,",
]


async def read_chunked_lines(reader: asyncio.StreamReader):
    """The lines of a chunked HTTP body, as they arrive."""
    pending = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        pending += await reader.readexactly(size)
        await reader.readexactly(2)
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode()


async def stream_completion(port: int, prompt: str, leave_after: int | None, reset: bool) -> str | None:
    """Streams one completion; returns its text, or None once it left after `leave_after`
    text chunks (-1: right after sending the request, 0: after the response headers), closing
    (or resetting) the socket."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    writer.write(head.encode() + body)
    await writer.drain()
    text, chunks = "", 0
    try:
        if leave_after == -1:
            return None
        status = await reader.readline()
        assert b" 200 " in status, status
        while (await reader.readline()).strip():
            pass
        if leave_after == 0:
            return None
        async for line in read_chunked_lines(reader):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            if chunk["choices"] and chunk["choices"][0]["text"]:
                text += chunk["choices"][0]["text"]
                chunks += 1
                if chunks == leave_after:
                    return None
        return text
    finally:
        if reset:
            # SO_LINGER 0: close sends a reset instead of a FIN.
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()


async def storm(port: int, rng: random.Random) -> list[tuple[str, int | None, str | None]]:
    """Every client at once; half leave at a random point. (prompt, leave_after, text) each."""
    plans = []
    for i in range(CLIENTS):
        leave = rng.randrange(-1, MAX_TOKENS) if i % 2 else None
        plans.append((rng.choice(PROMPTS), leave, rng.random() < 0.5))
    texts = await asyncio.gather(*(stream_completion(port, p, leave, reset) for p, leave, reset in plans))
    return [(p, leave, text) for (p, leave, _), text in zip(plans, texts)]


def allow_open_files(n: int) -> None:
    """Each client and its server side hold a socket: raise a low soft limit (the server
    inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))


# The second: two ranks with data-parallel attention, each holding its own pool and requests.
@pytest.mark.parametrize("flags", [(), ("--tp=2", "--enable-dp-attention")], ids=["one-rank", "dp-attention"])
def test_a_disconnect_storm_leaks_no_page_and_keeps_the_counters_consistent(start_server, flags):
    allow_open_files(4 * CLIENTS)
    server = start_server(DEVICE_FLAG, *flags)
    expected = {p: server.complete(p, MAX_TOKENS) for p in PROMPTS}
    before = server.wait_for_drain()  # under overlap the last request is counted once its step is back

    t0 = time.monotonic()
    results = asyncio.run(storm(server.port, random.Random(0)))
    m = server.wait_for_drain()
    print(f"storm of {CLIENTS} streams drained in {time.monotonic() - t0:.1f} s")

    # Those that stayed (and those that meant to leave after more text chunks than came) got
    # exactly what a lone request gets: no page freed under a live request was reused wrongly.
    assert all(text is not None for _, leave, text in results if leave is None)
    completed = [(p, text) for p, _, text in results if text is not None]
    stayed = len(completed)
    assert CLIENTS // 2 <= stayed < CLIENTS
    wrong = [(p, text) for p, text in completed if text != expected[p]]
    assert not wrong, wrong[:5]

    # The pool is whole again: pages are free or only in the prefix cache.
    assert m["nsaserve_kv_pages_free"] == m["nsaserve_kv_pages_total"] > 0, m
    assert m["nsaserve_kv_pages_used"] == 0

    def delta(name: str) -> float:
        return m[name] - before.get(name, 0.0)

    submitted = delta("nsaserve_engine_requests_submitted_total")
    finished = delta('nsaserve_engine_requests_ended_total{outcome="finished"}')
    aborted = delta('nsaserve_engine_requests_ended_total{outcome="aborted"}')
    failed = delta('nsaserve_engine_requests_ended_total{outcome="failed"}')
    print(f"engine: {submitted:.0f} submitted, {finished:.0f} finished, {aborted:.0f} aborted, {failed:.0f} failed")
    assert submitted == finished + aborted + failed, m
    assert failed == 0 and aborted > 0
    # Every client that stayed finished; a client that left may have been too late to abort.
    assert stayed <= finished and aborted <= CLIENTS - stayed and submitted <= CLIENTS, m
    # HTTP saw no errors; each response counted once, at most one per client.
    statuses = {k: v - before.get(k, 0.0) for k, v in m.items() if k.startswith("nsaserve_requests_total{")}
    assert all('status="200"' in k for k, v in statuses.items() if v), statuses
    assert stayed <= statuses['nsaserve_requests_total{endpoint="/v1/completions",status="200"}'] <= CLIENTS
    assert delta("nsaserve_e2e_request_latency_seconds_count") >= stayed

    # And it still serves exactly.
    assert server.complete(PROMPTS[0], MAX_TOKENS) == expected[PROMPTS[0]]
    assert server.stop() == 0
