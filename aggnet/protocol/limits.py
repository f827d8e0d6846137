"""Constants of the switch protocol (docs/protocol.md), shared by workers,
the aggregator host's switch mode and the P4 program, whose copies
(p4/aggnet/limits.p4 and wire.p4) are generated from this module.

Every bound, counter and drop reason lives here once: a test fails when
the committed P4 differs from what this module generates.
"""

from __future__ import annotations

import enum

from aggnet.protocol.wire import HEADER_SIZE

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
#: jobs one aggregator holds at once: the rows of its job tables (a
#: switch's jobs table and multicast groups, a host's shared job arrays);
#: 64 covers a rack's tenants
MAX_JOBS = 64
#: slots in a host aggregator's pool (the P4 program's is P4_POOL), and a
#: job's default slice of it on a switch
DEFAULT_POOL = 4096
#: slots in the P4 program's pool. A job's window is its slice of it; 1024
#: slots of 64 elements hold 256 KiB of sums per version, enough for a few
#: jobs' windows at the round trips of a rack (SwitchML used pools of
#: 128-512 slots)
P4_POOL = 1024
#: the P4 switch's multicast group that floods ordinary broadcast traffic
#: (ARP) to every port; a job's results go to group job row + 1, below it
FLOOD_GROUP = 1000
#: the member whose retransmission of a slot that waits on the parent makes
#: a rack resend its partial up. Every member retransmits when an uplink
#: packet is lost; the others' are duplicates, so a loss costs the uplink
#: one resend, not one per member
UPLINK_RESENDER = 0
DEFAULT_JOB_SLOTS = 128
#: the most slots one job may take on a host: a quarter of the default
#: pool, so that one JOIN (or one tenant) cannot take all of it. 1024
#: slots of 2048 values keep 8 MiB in flight per worker, far past what a
#: rack's round trips need (64 slots measured best at 1 Gbit/s)
MAX_JOB_SLOTS = 1024
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


#: bytes of the IPv4 (no options) and UDP headers before every datagram:
#: what a path MTU must hold besides the aggnet packet
IP_UDP_OVERHEAD = 28
#: a sharded aggregator serves a job's slice from at most this many
#: consecutive UDP ports (the shard sockets a worker sends to)
MAX_SHARD_PORTS = 64
#: the highest UDP port
MAX_PORT = 0xFFFF
#: the largest payload one message may carry on the service path (a chunk,
#: a block of sparse rows). Chunks of 1-4 MiB are fastest; a listener
#: refuses more (ZeroMQ drops the connection of a peer that sends it, UCX
#: ends it) instead of buffering whatever size a header or a frame claims
MAX_MESSAGE_BYTES = 64 << 20


def packet_bytes(elements: int) -> int:
    """aggnet header plus payload of ``elements`` int32 values (no L2-L4)."""
    return HEADER_SIZE + 4 * elements


def elements_for_mtu(mtu: int) -> int:
    """The most int32 values per packet whose datagram fits ``mtu`` (IPv4
    and UDP headers included), never fragmenting."""
    return max(0, min(MAX_ELEMENTS, (mtu - IP_UDP_OVERHEAD - HEADER_SIZE) // 4))


def shard_ports(base: int, slots: int, shard_slots: int) -> int:
    """The consecutive ports of a sharded aggregator (``shard_slots`` pool
    slots per port) that serve a slice of ``slots`` slots from ``base``."""
    return (base + slots - 1) // shard_slots + 1


def check_shard_layout(base: int, slots: int, shard_slots: int, first_port: int) -> None:
    """Raise ValueError, saying why, unless a peer can address every slot
    of the slice: a base that fits the header's 32 bits, at most
    MAX_SHARD_PORTS ports from ``first_port``, all of them valid ports."""
    ports = shard_ports(base, slots, shard_slots)
    if base >= 1 << 32 or ports > MAX_SHARD_PORTS or first_port + ports - 1 > MAX_PORT:
        raise ValueError(f"base {base} with {shard_slots} slots per shard puts {slots} slots on {ports} ports from "
                         f"{first_port}; at most {MAX_SHARD_PORTS}, below {MAX_PORT + 1}")


class Drop(enum.IntEnum):
    """Why an aggregator's data path drops a packet: the index of its
    counter, in the P4 program's ``drops`` counter (``DROP_<NAME>``) and
    among a host's counters (``dropped_<name>``)."""

    SHORT = 0  #: shorter than the header
    MAGIC = 1  #: not aggnet
    VERSION = 2  #: a wire version this build does not speak
    RESERVED = 3  #: the reserved field is not zero
    DTYPE = 4  #: a payload that is not int32
    LENGTH = 5  #: the length disagrees with the job's K (or a probe carries a payload)
    UNKNOWN_JOB = 6  #: no such job installed
    NOT_ADMITTED = 7  #: not a member of the job, or a final sum not from the parent
    INDEX = 8  #: a slot outside the job's slice
    STALE = 9  #: a use older than the slot's
    DUPLICATE = 10  #: a contribution the slot holds already
    EARLY = 11  #: the next use of a slot whose current use is incomplete
    EXPONENT = 12  #: a contribution quantized with another exponent
    FINAL = 13  #: a parent's final sum for a use this rack is not waiting on
    TYPE = 14  #: a message the P4 data plane does not take (a host passes it to its control)
    OTHER_SHARD = 15  #: a slot another shard of a host serves
    CONTROL_AT_DATA_SHARD = 16  #: a control message at a host shard other than the first


class Event(enum.IntEnum):
    """What an aggregator's data path counts besides drops: the index of
    its counter, in the P4 program's ``events`` counter (``EV_<NAME>``)
    and among a host's counters (``<name>``)."""

    RECEIVED = 0  #: packets to the aggregation port
    SUMMED = 1  #: contributions added into a slot
    COMPLETED = 2  #: results multicast to a job's members
    RESULTS_RESENT = 3  #: results sent again to a member that lost one
    UPLINK_SENT = 4  #: a rack's partial sums sent to its parent
    UPLINK_RESENT = 5  #: partial sums sent again
    FINALS = 6  #: a parent's final sums multicast to a rack's members
    PROBES = 7  #: probes answered
    JOINS = 8  #: JOINs the P4 data plane answered (a host answers them in its control)


def drop_counter(reason: Drop) -> str:
    """A host's name for the counter of ``reason``."""
    return f"dropped_{reason.name.lower()}"


def event_counter(event: Event) -> str:
    """A host's name for the counter of ``event``."""
    return event.name.lower()


def serial_newer(a: int, b: int) -> bool:
    """Tag ``a`` is newer than tag ``b`` in 32-bit serial arithmetic."""
    d = (a - b) & 0xFFFFFFFF
    return 0 < d < 0x80000000
