"""Slow and hostile clients against `serve` over raw sockets: a slowloris connection is closed
after --header-timeout, a slow body gets 408 after --body-timeout, a large body gets 413, and
with 2,000 idle connections open (against --max-connections 256) a new request still succeeds.
Runs on the null executor: these limits are the router's alone."""

from __future__ import annotations

import json
import resource
import socket
import time

import pytest
from server_process import ServerProcess

from nsaserve.serve import EMBEDDED_MODEL

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")

FLOOD = 2000


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(s: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; fails if it is still open after `limit` s."""
    started, out = time.monotonic(), b""
    s.settimeout(limit)
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"still open after {limit} s; got {out!r}") from None
        if not chunk:
            return out, time.monotonic() - started
        out += chunk


def health_on_a_new_connection(server) -> int:
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        response, _ = read_until_closed(s, 10)
    return int(response.split(b" ", 2)[1])


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(
        "--model-executor=null",
        "--header-timeout=1",
        "--body-timeout=1",
        "--keep-alive-timeout=30",
        "--max-request-bytes=1000",
        "--max-connections=256",
    ).wait_ready()
    yield s
    assert s.stop() == 0


def test_slowloris_headers_are_closed_after_the_header_timeout(server):
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        _, waited = read_until_closed(s, 5)
    assert 0.5 < waited < 3


def test_a_slow_body_gets_408(server):
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
        response, waited = read_until_closed(s, 5)
    assert response.startswith(b"HTTP/1.1 408"), response
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert waited < 3


def test_a_large_body_gets_413_as_an_openai_error(server):
    body = json.dumps({"prompt": "x" * 2000}).encode()
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n")
        s.sendall(b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        response, _ = read_until_closed(s, 5)
    assert response.startswith(b"HTTP/1.1 413"), response
    error = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"


def test_an_idle_connection_flood_cannot_keep_new_requests_out(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 200:
        if hard != resource.RLIM_INFINITY and hard < FLOOD + 200:
            pytest.skip(f"needs {FLOOD + 200} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD + 200, hard))
    idle = []
    try:
        for i in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\n")  # half a request head
            idle.append(s)
        for _ in range(10):
            started = time.monotonic()
            assert health_on_a_new_connection(server) == 200
            assert time.monotonic() - started < 3
    finally:
        for s in idle:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
