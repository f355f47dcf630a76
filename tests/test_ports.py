"""``ports.free_port``: below the ephemeral range, free with its SGLang-derived ports, never the
same port (or an overlapping derived block) twice in one process."""

from __future__ import annotations

import random
import socket

from sglang_dsv4 import ports


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except OSError:
        return 32768


def test_ports_are_below_the_ephemeral_range_and_below_sglangs_nccl_range():
    assert ports.PORT_RANGE.stop + max(ports.DERIVED_PORT_OFFSETS) < min(_ephemeral_low(), 22000)


def test_a_port_is_bindable_and_never_handed_out_twice():
    picks = [ports.free_port() for _ in range(20)]
    blocks = [{p, *(p + d for d in ports.DERIVED_PORT_OFFSETS)} for p in picks]
    assert all(p in ports.PORT_RANGE for p in picks)
    assert sum(len(b) for b in blocks) == len(set().union(*blocks))  # no two blocks overlap
    with socket.socket() as s:
        s.bind(("0.0.0.0", picks[-1]))


def test_a_port_whose_derived_port_is_bound_is_skipped():
    first = random.Random(7).choice(ports.PORT_RANGE)  # what the seeded draw offers first
    # its whole block off this process's list: only the bound port below can make it skipped
    ports._handed_out.difference_update({first, *(first + d for d in ports.DERIVED_PORT_OFFSETS)})
    with socket.socket() as busy:
        try:
            busy.bind(("0.0.0.0", first + ports.DERIVED_PORT_OFFSETS[0]))
        except OSError:
            pass  # already bound elsewhere: skipped all the same
        assert ports.free_port(random.Random(7)) != first
