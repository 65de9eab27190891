"""A small asyncio HTTP/1.1 client: a keep-alive connection pool, JSON POSTs, and streamed
responses read as server-sent events with the arrival time of every event.

It exists so the load generator adds no dependency and so timestamps are taken the moment bytes
come off the socket (no library buffering in between). It only needs to talk to well-behaved
servers over plain http://: no TLS, no redirects, no proxies, no compression.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

READ_SIZE = 65536


class HttpError(Exception):
    """A non-2xx response; `body` is the (decoded) response body."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class ProtocolError(Exception):
    """The server broke HTTP framing, e.g. closed the connection in the middle of a body."""


@dataclass
class SseEvent:
    """One SSE event: its `data:` lines joined by newlines, and when its last byte arrived
    (time.perf_counter())."""

    data: str
    arrived: float


class SseParser:
    """Incremental SSE parser: feed bytes, get complete events. Only `data:` fields matter here;
    comments (keep-alives) and other fields are skipped."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes, arrived: float) -> list[SseEvent]:
        self._buf += chunk
        events = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buf = self._buf[nl + 1 :]
            if line == "":
                if self._data:
                    events.append(SseEvent("\n".join(self._data), arrived))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def finish(self, arrived: float) -> list[SseEvent]:
        """An event left without its blank line when the body ended still counts."""
        if self._buf.strip():
            self.feed(b"\n", arrived)
        return self.feed(b"\n", arrived) if self._data else []


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.reused = False

    def close(self) -> None:
        self.writer.close()


@dataclass
class _Head:
    status: int
    headers: dict[str, str]


class HttpClient:
    """Keep-alive pool for one base URL. One connection carries one request at a time; idle ones
    are reused, so at steady state there are as many connections as requests in flight."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, connect_timeout: float = 30.0):
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, got {base_url!r}")
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/")
        self.headers = {"Host": f"{self.host}:{self.port}", "User-Agent": "nsaserve-bench", **(headers or {})}
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()
        for c in idle:
            try:
                await c.writer.wait_closed()
            except OSError:
                pass

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, limit=1 << 22), self.connect_timeout
        )
        return _Connection(reader, writer)

    def _acquire(self) -> _Connection | None:
        while self._idle:
            c = self._idle.pop()
            if not c.reader.at_eof() and not c.writer.is_closing():
                c.reused = True
                return c
            c.close()
        return None

    def _release(self, conn: _Connection, keep_alive: bool) -> None:
        if keep_alive and not conn.reader.at_eof():
            self._idle.append(conn)
        else:
            conn.close()

    async def _send(self, method: str, path: str, body: bytes | None, extra: dict[str, str]) -> tuple[_Connection, _Head]:
        """Send a request and read the status line and headers. A reused idle connection that
        the server closed meanwhile fails before any response byte: retry once on a fresh one."""
        lines = [f"{method} {self.prefix}{path} HTTP/1.1"]
        headers = {**self.headers, **extra}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        lines += [f"{k}: {v}" for k, v in headers.items()]
        raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")
        for attempt in range(2):
            conn = self._acquire() if attempt == 0 else None
            conn = conn or await self._connect()
            try:
                conn.writer.write(raw)
                await conn.writer.drain()
                status_line = await conn.reader.readline()
                if not status_line:
                    raise ProtocolError("connection closed before the response")
                return conn, await self._read_head(conn, status_line)
            except (ProtocolError, ConnectionError) as e:
                conn.close()
                if not conn.reused or attempt == 1:
                    raise ProtocolError(str(e) or type(e).__name__) from e
            except BaseException:  # a timeout or cancellation: the connection is mid-request
                conn.close()
                raise
        raise AssertionError("unreachable")

    @staticmethod
    async def _read_head(conn: _Connection, status_line: bytes) -> _Head:
        parts = status_line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {status_line[:100]!r}")
        headers: dict[str, str] = {}
        while True:
            line = await conn.reader.readline()
            if not line:
                raise ProtocolError("connection closed in the response headers")
            line = line.rstrip(b"\r\n")
            if not line:
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return _Head(int(parts[1]), headers)

    @staticmethod
    def _reusable(head: _Head) -> bool:
        """After a fully read body, the connection can carry another request if the body was
        framed (a body read until close ends the connection) and the server did not say close."""
        framed = "content-length" in head.headers or "chunked" in head.headers.get("transfer-encoding", "").lower()
        return framed and head.headers.get("connection", "").lower() != "close"

    async def _body_chunks(self, conn: _Connection, head: _Head) -> AsyncIterator[bytes]:
        """The body as it arrives: chunked, Content-Length, or (neither) until the server closes."""
        r = conn.reader
        if "chunked" in head.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await r.readline()
                if not size_line:
                    raise ProtocolError("connection closed in the middle of a chunked body")
                try:
                    size = int(size_line.split(b";")[0].strip(), 16)
                except ValueError as e:
                    raise ProtocolError(f"bad chunk size line {size_line[:50]!r}") from e
                if size == 0:
                    while (await r.readline()).rstrip(b"\r\n"):  # trailers, then the blank line
                        pass
                    return
                try:
                    data = await r.readexactly(size + 2)
                except asyncio.IncompleteReadError as e:
                    raise ProtocolError("connection closed in the middle of a chunked body") from e
                yield data[:-2]
        elif "content-length" in head.headers:
            left = int(head.headers["content-length"])
            while left > 0:
                data = await r.read(min(left, READ_SIZE))
                if not data:
                    raise ProtocolError(f"connection closed with {left} body bytes missing")
                left -= len(data)
                yield data
        else:
            while data := await r.read(READ_SIZE):
                yield data

    async def request(self, method: str, path: str, json_body: object | None = None) -> tuple[int, bytes]:
        """A whole request: (status, body bytes). Non-2xx statuses are returned, not raised."""
        body = None if json_body is None else json.dumps(json_body).encode()
        extra = {"Content-Type": "application/json"} if body is not None else {}
        conn, head = await self._send(method, path, body, extra)
        try:
            data = b"".join([c async for c in self._body_chunks(conn, head)])
        except BaseException:
            conn.close()
            raise
        self._release(conn, self._reusable(head))
        return head.status, data

    async def post_json(self, path: str, body: object) -> object:
        status, data = await self.request("POST", path, body)
        if not 200 <= status < 300:
            raise HttpError(status, data.decode("utf-8", errors="replace"))
        return json.loads(data)

    async def get_text(self, path: str) -> tuple[int, str]:
        status, data = await self.request("GET", path)
        return status, data.decode("utf-8", errors="replace")

    async def post_sse(self, path: str, body: object) -> AsyncIterator[SseEvent]:
        """POST JSON and yield the SSE events of the response as they arrive. A non-2xx status
        raises HttpError with the body; a body cut short raises ProtocolError."""
        raw = json.dumps(body).encode()
        conn, head = await self._send("POST", path, raw, {"Content-Type": "application/json", "Accept": "text/event-stream"})
        complete = False
        try:
            if not 200 <= head.status < 300:
                data = b"".join([c async for c in self._body_chunks(conn, head)])
                complete = True
                raise HttpError(head.status, data.decode("utf-8", errors="replace"))
            parser = SseParser()
            async for chunk in self._body_chunks(conn, head):
                for event in parser.feed(chunk, time.perf_counter()):
                    yield event
            complete = True
            for event in parser.finish(time.perf_counter()):
                yield event
        finally:
            # A stream abandoned half-way (consumer stopped, error, cancellation) leaves unread
            # bytes on the connection, so only a fully read body goes back to the pool.
            self._release(conn, complete and self._reusable(head))
