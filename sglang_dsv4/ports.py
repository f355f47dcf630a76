"""Free TCP ports for the servers and process groups this project starts (tests, benchmarks,
``parallel_check``).

A port found by ``bind(port 0)`` lies in the kernel's ephemeral range, which the kernel also hands
out as the source port of every outgoing connection (gloo, ZMQ, HTTP clients). A server that binds
its port only after a minute of start-up can find it taken meanwhile by such a connection: CI's run
of stop 26 failed so ("[Errno 98] address already in use" while the other server's gloo ranks were
connecting). So ports come from below the ephemeral range, and below SGLang's own pick for NCCL
ports (``get_free_port_below_ephemeral``, 22000-29999), so a concurrently starting server cannot
pick it either.
"""

from __future__ import annotations

import random
import socket

# SGLang's ports derived from ``--port`` under data-parallel attention: ``port + 233``
# (``ZMQ_TCP_PORT_DELTA``, the dist-init port) and the 7 after it (``PortArgs.init_new``).
DERIVED_PORT_OFFSETS = range(233, 241)
PORT_RANGE = range(10000, 21000)

_handed_out: set[int] = set()  # this process's earlier picks, not yet bound by their servers


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False


def free_port(rng: random.Random | None = None, attempts: int = 200) -> int:
    """A port outside the ephemeral range that is free now, whose SGLang-derived ports are free,
    and that this process has not handed out before (two servers started together never collide)."""
    rng = rng or random.SystemRandom()
    for _ in range(attempts):
        port = rng.choice(PORT_RANGE)
        taken = {port, *(port + d for d in DERIVED_PORT_OFFSETS)}
        if taken & _handed_out or not all(_bindable(p) for p in taken):
            continue
        _handed_out.update(taken)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE.start}-{PORT_RANGE.stop - 1} after {attempts} attempts")
