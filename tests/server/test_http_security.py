"""What `serve` exposes: worker sockets in a private directory (or on TCP only when asked, bound
to the given host), the HTTP port on the given host only, and no request or response text in
the log at info level. Runs on the null executor: no model is needed to check any of it."""

from __future__ import annotations

import json
import os
import socket
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from server_process import descendants

from nsaserve.serve import EMBEDDED_MODEL

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")

NULL = "--model-executor=null"


def listening_tcp(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of `pids` holds (IPv4)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and inode in inodes:
            hex_ip, hex_port = local.split(":")
            ip = ".".join(str(b) for b in reversed(bytes.fromhex(hex_ip)))
            out.add((ip, int(hex_port, 16)))
    return out


def server_pids(server) -> set[int]:
    return {server.proc.pid} | descendants(server.proc.pid)


def test_ipc_sockets_live_in_a_private_directory_and_nothing_else_listens(start_server):
    server = start_server(NULL)
    runtime = [p for p in Path(server.tmp.name).iterdir() if p.name.startswith("nsaserve-")]
    assert len(runtime) == 1, runtime
    assert stat.S_IMODE(runtime[0].stat().st_mode) == 0o700
    sockets = sorted(p.name for p in runtime[0].iterdir())
    assert "events" in sockets and "plan-0" in sockets, sockets
    # Only the HTTP port, on the host given (127.0.0.1 by default).
    assert listening_tcp(server_pids(server)) == {("127.0.0.1", server.port)}
    assert server.stop() == 0


def two_held_ports() -> tuple[int, list[socket.socket]]:
    """Two consecutive free ports, held (bound) until the caller closes the sockets."""
    while True:
        first = socket.socket()
        first.bind(("127.0.0.1", 0))
        second = socket.socket()
        try:
            second.bind(("127.0.0.1", first.getsockname()[1] + 1))
            return first.getsockname()[1], [first, second]
        except OSError:
            first.close()
            second.close()


def test_tcp_worker_sockets_only_when_asked_and_on_the_given_host(start_server):
    # Held while the server picks its HTTP port, so that it cannot pick one of them.
    base, held = two_held_ports()
    server = start_server(
        NULL, "--worker-transport=tcp", "--worker-host=127.0.0.1", f"--worker-base-port={base}", ready=False
    )
    for s in held:
        s.close()
    server.wait_ready()
    assert not [p for p in Path(server.tmp.name).iterdir() if p.name.startswith("nsaserve-")]
    assert listening_tcp(server_pids(server)) == {("127.0.0.1", server.port), ("127.0.0.1", base), ("127.0.0.1", base + 1)}
    assert server.stop() == 0


def test_no_prompt_or_output_text_in_the_log_at_info_level(start_server):
    server = start_server(NULL, "--log-level=info")
    marker = "zanzibar-quokka-7431"
    requests = [
        ("/v1/completions", {"prompt": f"say {marker}", "max_tokens": 4, "echo": True}),
        ("/v1/completions", {"prompt": [f"{marker} a", f"{marker} b"], "max_tokens": 2, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": marker}], "max_tokens": 4}),
        # A refused request too: its error must not be logged with the text either.
        ("/v1/completions", {"prompt": marker, "max_tokens": 10**6}),
    ]
    echoed = ""
    for path, body in requests:
        req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                echoed += r.read().decode()
        except urllib.error.HTTPError as e:
            assert e.code == 400
    assert marker in echoed  # the marker did reach the output (echo)
    assert server.stop() == 0
    assert marker not in server.output, server.output
