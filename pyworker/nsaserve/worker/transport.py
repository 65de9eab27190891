"""The worker's ZeroMQ sockets (the router binds; workers connect). See router/src/transport.rs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class Endpoints:
    events: str  # every rank PUSHes hello / heartbeat / fatal / results here
    plans: str  # this rank PULLs plans from here

    @staticmethod
    def ipc(runtime_dir: str, rank: int) -> Endpoints:
        return Endpoints(f"ipc://{os.path.join(runtime_dir, 'events')}", f"ipc://{os.path.join(runtime_dir, f'plan-{rank}')}")

    @staticmethod
    def tcp(host: str, base_port: int, rank: int) -> Endpoints:
        return Endpoints(f"tcp://{host}:{base_port}", f"tcp://{host}:{base_port + 1 + rank}")


class WorkerSockets:
    def __init__(self, endpoints: Endpoints, ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.endpoints = endpoints
        self.events = self.new_event_socket()
        self.plans = self.ctx.socket(zmq.PULL)
        self.plans.setsockopt(zmq.RCVHWM, 0)
        self.plans.setsockopt(zmq.LINGER, 0)
        self.plans.connect(endpoints.plans)

    def new_event_socket(self) -> zmq.Socket:
        """A PUSH socket to the router's events endpoint (one per thread: sockets are not thread-safe)."""
        s = self.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 2000)  # let a final fatal message reach the router
        s.connect(self.endpoints.events)
        return s

    def send(self, data: bytes) -> None:
        self.events.send(data)

    def recv_plan(self) -> bytes:
        return self.plans.recv(copy=True)

    def plan_waiting(self) -> bool:
        """Whether recv_plan would return at once."""
        return bool(self.plans.poll(0))

    def close(self) -> None:
        self.events.close()
        self.plans.close()
