"""What the simulator knows of a machine: links, aggregators and hosts, as
numbers with their source.

Every preset names where each number comes from: a datasheet or paper for
hardware no lab here owns, a measurement (``aggnet sim calibrate``, a
benchmark's JSON) for this machine. A parameter file (JSON) overrides any
field by name, so a measured machine is described without code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from aggnet.emulation.fabric_plan import BMV2_SLOTS
from aggnet.protocol.limits import IP_UDP_OVERHEAD
from aggnet.protocol.wire import HEADER_SIZE

#: bytes a frame costs on the wire beyond its IP packet: Ethernet header
#: and FCS (18), preamble and inter-frame gap (20)
ETHERNET_OVERHEAD = 38
#: TCP/IP headers with timestamps, per segment
TCP_IP_OVERHEAD = 52


@dataclass(frozen=True)
class Hardware:
    """One machine class: its links, its aggregators and its hosts.

    Rates are bytes per second of the link's line rate; times in seconds."""

    name: str
    #: a worker's link to its rack switch, each way
    host_rate: float
    #: MTU of every link (jumbo frames: 9000)
    mtu: int = 9000
    #: the switch aggregator: values per packet, pool slots, the job's
    #: window in slots, and its pipeline's latency per pass
    switch_elements: int = 64
    switch_pool: int = 8192
    switch_window: int = 512
    switch_latency: float = 1e-6
    #: pipeline passes (a packet in, or a copy out) a switch makes per
    #: second; 0: line rate, never the bottleneck (a hardware pipeline).
    #: BMv2, a software switch, makes about two thousand
    switch_passes_per_s: float = 0.0
    #: a host aggregator (PBox-style shards): shards per host, datagrams per
    #: second one shard takes, and its link's rate in multiples of a host link
    host_agg_shards: int = 2
    host_agg_packets_per_s: float = 1.0e6
    host_agg_link_factor: float = 4.0
    #: values per datagram on a host aggregator (jumbo frames)
    host_agg_elements: int = 2048
    #: a worker's CPU-seconds per byte of buffer for aggnet's client (quantize,
    #: packets, dequantize) and for a ring's (TCP and summation), when that
    #: is the bottleneck rather than the link (0: never)
    client_cpu_s_per_byte: float = 0.0
    ring_cpu_s_per_byte: float = 0.0
    #: one-way latency of a link plus a switch hop, and a software step's
    #: fixed cost (a ring's per-step latency: kernel, stack, synchronisation)
    hop_latency: float = 1e-6
    step_latency: float = 10e-6
    #: what a second level of aggregation (racks under a root) adds to a
    #: slot's round trip beyond its links' serialisation; None: two more
    #: hops and the root's own pass, as the first level has. Host
    #: aggregators measured in an emulation add far less than a first
    #: level: the worker's own send and receive path is paid once.
    root_latency: float | None = None
    #: retransmission timeout of the switch protocol (its floor)
    rto: float = 0.02
    #: an aggregator host's CPU-seconds per byte its members send it
    host_agg_cpu_s_per_byte: float = 0.0
    #: every process of the fabric shares one machine of this many cores
    #: (an emulation: workers and aggregators in namespaces of one host);
    #: 0: each host has cores of its own
    machine_cores: float = 0.0
    #: where each number comes from
    sources: dict = field(default_factory=dict)

    def replace(self, **changes) -> "Hardware":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown hardware parameter(s) {sorted(unknown)}; known: "
                             f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    # -- what a byte costs on the wire -------------------------------------------------

    def switch_efficiency(self, elements: int | None = None) -> float:
        """Payload bytes per wire byte of the switch protocol."""
        k = elements or self.switch_elements
        return 4 * k / (4 * k + HEADER_SIZE + IP_UDP_OVERHEAD + ETHERNET_OVERHEAD)

    def tcp_efficiency(self) -> float:
        """Payload bytes per wire byte of a TCP stream at this MTU."""
        payload = self.mtu - TCP_IP_OVERHEAD
        return payload / (self.mtu + ETHERNET_OVERHEAD)


GBIT = 1e9 / 8

#: hardware no lab here owns, from what its makers and users published
PRESETS: dict[str, Hardware] = {
    "tofino-100g": Hardware(
        "tofino-100g", host_rate=100 * GBIT, mtu=9000, switch_elements=64, switch_pool=8192, switch_window=512,
        switch_latency=1e-6, host_agg_shards=16, host_agg_packets_per_s=2.0e6, host_agg_link_factor=1.0,
        host_agg_elements=2048, hop_latency=1e-6, step_latency=10e-6, rto=1e-3,
        sources={
            "host_rate": "100 GbE NICs and Tofino ports (SwitchML, NSDI'21, testbed)",
            "switch_elements": "SwitchML's 64 32-bit values per packet (NSDI'21, section 5)",
            "switch_pool": "an 8,192-slot pool (issue 25; SwitchML sizes its pool to the bandwidth-delay product)",
            "switch_window": "slots per job in flight: 512 x 256 B covers 100 Gbit/s x 10 us",
            "switch_latency": "a Tofino pipeline pass, under a microsecond (Intel Tofino product brief)",
            "host_agg_packets_per_s": "a DPDK core's datagrams per second (SwitchML needed several cores per "
                                      "100 Gbit/s worker)",
            "step_latency": "a ring step's software cost at 100 Gbit/s (NCCL over RoCE, order of 10 us)",
            "rto": "SwitchML's retransmission timeout, 1 ms",
        }),
    "tofino2-400g": Hardware(
        "tofino2-400g", host_rate=400 * GBIT, mtu=9000, switch_elements=64, switch_pool=8192, switch_window=2048,
        switch_latency=1e-6, host_agg_shards=32, host_agg_packets_per_s=2.0e6, host_agg_link_factor=1.0,
        host_agg_elements=2048, hop_latency=1e-6, step_latency=8e-6, rto=1e-3,
        sources={
            "host_rate": "400 GbE ports of a Tofino 2 (12.8 Tbit/s, Intel product brief)",
            "switch_elements": "SwitchML's 64 values per packet, kept",
            "switch_window": "2,048 x 256 B covers 400 Gbit/s x 10 us",
        }),
    # ``aggnet emulate``'s fabric before calibration: its links are set per
    # run, its CPU figures come from ``aggnet sim calibrate``
    "emulation": Hardware(
        "emulation", host_rate=100e6 / 8, mtu=9000, host_agg_shards=2, host_agg_link_factor=4.0,
        host_agg_elements=2048, hop_latency=50e-6, step_latency=100e-6, rto=0.02, machine_cores=2,
        switch_window=BMV2_SLOTS,
        sources={
            "switch_window": "an emulated P4 rack's slots per job (emulation.fabric_plan.BMV2_SLOTS)",
            "host_rate": "aggnet emulate's --rate (tc tbf on every veth)",
            "mtu": "aggnet emulate's default, jumbo frames",
            "host_agg_link_factor": "an emulated rack's aggregator host has a link of N host links",
            "host_agg_elements": "a host in switch mode: 2048 values per datagram at MTU 9000",
            "rto": "aggnet.protocol.limits.RTO_MIN, the floor of the client's adaptive timeout",
            "machine_cores": "every process of an emulation shares one machine (replaced by calibrate)",
        }),
}


def load(name_or_path: str | None, overrides: dict | None = None) -> Hardware:
    """A preset by name, or a JSON file of fields (``base`` names the
    preset it starts from); ``overrides`` last."""
    if name_or_path is None:
        name_or_path = "tofino-100g"
    if name_or_path in PRESETS:
        hw = PRESETS[name_or_path]
    else:
        try:
            with open(name_or_path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"no hardware preset or parameter file {name_or_path!r}; presets: "
                             f"{', '.join(PRESETS)}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name_or_path}: not JSON ({exc})") from None
        data.pop("measured", None)  # what aggnet sim calibrate measured, kept for the record
        base = PRESETS.get(data.pop("base", "tofino-100g"))
        if base is None:
            raise ValueError(f"{name_or_path}: base must be one of {', '.join(PRESETS)}")
        sources = {**base.sources, **data.pop("sources", {})}
        hw = base.replace(name=data.pop("name", name_or_path), sources=sources, **data)
    return hw.replace(**overrides) if overrides else hw


__all__ = ["Hardware", "PRESETS", "GBIT", "load"]
