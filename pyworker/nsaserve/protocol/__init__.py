"""The router <-> worker protocol (see docs/protocol.md): typed messages and their msgpack codec."""
