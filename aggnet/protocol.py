"""Constants of the switch protocol (docs/protocol.md), shared by workers,
the aggregator host's switch mode and the P4 program's generated header."""

from __future__ import annotations

from .wire import HEADER_SIZE

#: UDP port aggregators listen on (0xA66E, the header's magic)
SWITCH_PORT = 42606
#: int32 elements per packet: the P4 program is built with this many; host
#: aggregators accept any K up to MAX_ELEMENTS, agreed at JOIN
DEFAULT_ELEMENTS = 64
MAX_ELEMENTS = 2048
#: workers per job on one aggregator: the seen bitmap is 32 bits wide
MAX_WORKERS = 32
#: slots in an aggregator's pool, and a job's default slice of it
DEFAULT_POOL = 1024
DEFAULT_JOB_SLOTS = 128
#: retransmission timeout: the floor of the adaptive estimate (smoothed
#: round trip + 4 deviations) and the cap of its doubling per retry
RTO_MIN = 0.02
RTO_MAX = 0.256
#: the timeout before any round trip has been measured: the first window
#: may sit in a switch queue for tens of milliseconds on a slow link
RTO_INITIAL = 0.2


def packet_bytes(elements: int) -> int:
    """aggnet header plus payload of ``elements`` int32 values (no L2-L4)."""
    return HEADER_SIZE + 4 * elements


def serial_newer(a: int, b: int) -> bool:
    """Tag ``a`` is newer than tag ``b`` in 32-bit serial arithmetic."""
    d = (a - b) & 0xFFFFFFFF
    return 0 < d < 0x80000000
