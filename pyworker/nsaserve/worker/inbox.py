"""The plan socket as the step loop reads it: plans and shutdown in order, and the `masks`
messages that rank 0 waits for inside a step (protocol/late_masks.py).

The router sends a step's late masks after committing the step before it and before it sends the
next plan, so a worker waiting for them finds them next on the socket. Masks nobody waits for
(their rows were dropped on receipt) are skipped; a plan that arrives while masks are awaited
(which only a router that could not send them would cause) is held for the step loop, and the
late rows fail.
"""

from __future__ import annotations

from collections import deque

import msgpack

from ..protocol.arrays import ProtocolError
from ..protocol.messages import LateMasks, late_masks_from_msg, unpack


def message_kind(data: bytes) -> str | None:
    """The `kind` of a message whose first key is `kind` (as every encoder here writes it), read
    from its first bytes without decoding the rest; None when it cannot be read that way."""
    u = msgpack.Unpacker(raw=False)
    u.feed(data[:32])
    try:
        if u.read_map_header() < 1 or u.unpack() != "kind":
            return None
        kind = u.unpack()
    except Exception:  # noqa: BLE001 - truncated or not a map: the full decode says what is wrong
        return None
    return kind if isinstance(kind, str) else None


class PlanInbox:
    def __init__(self, recv, waiting):
        self._recv = recv  # () -> bytes, blocking
        self._waiting = waiting  # () -> bool: whether _recv would return at once
        self._held: deque[bytes] = deque()

    def recv(self) -> bytes:
        """The next plan or shutdown message (late masks nobody waited for are skipped)."""
        while True:
            data = self._held.popleft() if self._held else self._recv()
            if message_kind(data) != "masks":
                return data

    def waiting(self) -> bool:
        """Whether recv() would return at once."""
        if self._held:
            return True
        while self._waiting():
            data = self._recv()
            if message_kind(data) != "masks":
                self._held.append(data)
                return True
        return False

    def masks_for(self, step: int) -> LateMasks | None:
        """Blocks until the `masks` message of `step` arrives; None when something else comes
        first (held for recv()) or the message cannot be read."""
        while True:
            if self._held:
                return None
            data = self._recv()
            if message_kind(data) != "masks":
                self._held.append(data)
                return None
            try:
                masks = late_masks_from_msg(unpack(data))
            except ProtocolError:
                return None
            if masks.step == step:
                return masks
            # An older step's masks (its plan was dropped on receipt): skip.


__all__ = ["PlanInbox", "message_kind"]
