"""Constants of the switch protocol (docs/protocol.md), shared by workers,
the aggregator host's switch mode and the P4 program's generated header."""

from __future__ import annotations

from .wire import HEADER_SIZE

#: UDP port aggregators listen on (0xA66E, the header's magic)
SWITCH_PORT = 42606
#: int32 elements per packet: the P4 program is built with this many
DEFAULT_ELEMENTS = 64
#: an aggregator host's K for jobs that do not ask (agreed at JOIN): 8 KiB of
#: payload, 8240-byte datagrams that fit a 9000-byte jumbo frame. Per-packet
#: costs (a GSO segment, a header parse) then weigh 1/32 of what they do at
#: 64 values; a worker whose path MTU is smaller gets what fits it.
DEFAULT_HOST_ELEMENTS = 2048
#: the most a host aggregator sums per packet (a 64 KiB datagram)
MAX_ELEMENTS = 16364
#: workers per job on one aggregator: the seen bitmap is 32 bits wide
MAX_WORKERS = 32
#: slots in a host aggregator's pool (the P4 program's pool is 1024), and a
#: job's default slice of it on a switch
DEFAULT_POOL = 4096
DEFAULT_JOB_SLOTS = 128
#: the most slots one job may take on a host
MAX_JOB_SLOTS = 4096
#: bytes of payload a job keeps in flight per worker when it does not say
#: how many slots it wants. Measured (docs/benchmarks.md): on loopback 64
#: and 128 slots of 2048 values tie within noise (1.2-1.8 GB/s), and in a
#: 1 Gbit/s rack 64 slots beat 128 and 256 (every all-reduce primes each
#: slot it uses once, a full packet of zeros, so a wider window costs bytes)
WINDOW_BYTES = 512 << 10


def auto_slots(elements: int) -> int:
    """The slots a host gives a job of ``elements`` per packet that asked
    for none: WINDOW_BYTES in flight, 16 to 1024 slots."""
    return max(16, min(1024, WINDOW_BYTES // (4 * elements)))


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


def elements_for_mtu(mtu: int) -> int:
    """The most int32 values per packet whose datagram fits ``mtu`` (IPv4
    and UDP headers included), never fragmenting."""
    return max(0, min(MAX_ELEMENTS, (mtu - 28 - HEADER_SIZE) // 4))


def serial_newer(a: int, b: int) -> bool:
    """Tag ``a`` is newer than tag ``b`` in 32-bit serial arithmetic."""
    d = (a - b) & 0xFFFFFFFF
    return 0 < d < 0x80000000
