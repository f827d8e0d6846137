"""aggnet's one typed configuration, read at the edge.

Library code takes a :class:`ClientConfig`; only :meth:`ClientConfig.from_env`
(called by the CLI, the DDP hook and the embedded default) reads the
environment. Every setting is checked when the object is made, and a bad
value is shown in the error.

Environment variables:

=====================  ====================================================
``AGGNET_ADDRESS``     aggregator service address (unset: embedded local one)
``AGGNET_TIMEOUT``     seconds an all-reduce may go without progress
``AGGNET_CHUNK_BYTES`` wire bytes per chunk (``1MiB``, ``262144``)
``AGGNET_WINDOW``      chunks in flight per aggregator shard
``AGGNET_SHARDS``      shards of an embedded aggregator (default: cores)
``AGGNET_SLOTS``       switch protocol: slots of the pool a job asks for
``AGGNET_ELEMENTS``    switch protocol: int32 elements per packet
``AGGNET_UDP_IO``      switch protocol: gso, mmsg or plain (default: best)
``AGGNET_JOB_KEY``     the job's key (hex, ``aggnet job create``): signs JOINs
``AGGNET_SERVER_KEY``  the service's CURVE public key (zmq+tcp with CURVE)
``AGGNET_TOPOLOGY``    a topology file: each rank finds its rack's aggregator
``AGGNET_CODEC``       aggnet.torch's float32 wire format: float32, int32, fp16, bf16
``AGGNET_RESUME``      0: an aggregator restart fails the all-reduces in flight
``AGGNET_ALL_OR_NOTHING`` 1/0: a failed all-reduce restores the buffer (default: yes, not under aggnet.torch)
``AGGNET_DEVICE_PATH`` device (CUDA) buffers: direct (as they are, over ucx) or staged (pinned host copy)
``AGGNET_CUDA_DELEGATE`` the aggnet torch backend's other CUDA collectives: gloo (default) or nccl
=====================  ====================================================
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace

from aggnet.protocol.limits import MAX_ELEMENTS, MAX_MESSAGE_BYTES

#: wire bytes per chunk, by transport; measured with `aggnet bench
#: --chunk-bytes 64KiB,256KiB,1MiB,2MiB,4MiB` on the reference 2-core machine
#: (docs/benchmarks.md). Each message costs tens of microseconds of Python on
#: both ends, so 32 KiB chunks (PHub's InfiniBand size) are message-rate
#: bound: over ZeroMQ 64 KiB took 2.9x as long as 1 MiB, and 1 MiB and 4 MiB
#: tie, so 1 MiB keeps a 25 MiB DDP bucket spread over every shard. Over
#: shared memory, where the data never crosses a socket, 2 MiB is fastest
#: (70 ms for 4 x 100 MiB, against 102 ms at 1 MiB and 84 ms at 4 MiB, whose
#: accumulators no longer stay in cache).
DEFAULT_CHUNK_BYTES = 1 << 20
SHM_CHUNK_BYTES = 2 << 20
#: under a root, the seconds of its uplink's time one chunk may take. A rack
#: sends a chunk's partial up only once every worker's part of it is in, and
#: the root's result comes down whole, so a slow uplink's pipeline fills and
#: drains by whole chunks: at 100 Mbit/s a 1 MiB chunk takes 84 ms each way,
#: and 1 MiB chunks left two service racks 17% over the time their uplinks
#: need, 256 KiB ones 6% (docs/benchmarks.md). Where the uplink binds,
#: the CPU that smaller chunks cost a host is not what decides.
UPLINK_CHUNK_SECONDS = 0.025
#: the smallest chunk a slow uplink's rule picks (smaller ones are message-rate
#: bound on the hosts)
MIN_UPLINK_CHUNK_BYTES = 256 << 10
#: chunks in flight per shard: enough to overlap one chunk's transfer with
#: the previous one's summation and the result's return.
DEFAULT_WINDOW = 4

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30}


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` ("1MiB", "100MiB", "32KiB", "4096")."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use a number with an optional unit like 32KiB, 1MiB, 100MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("use 1 or 0")


def format_size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class ClientConfig:
    #: service address; None starts (rank 0) or finds an embedded local one
    address: str | None = None
    #: seconds an all-reduce may go without any progress before it fails
    timeout: float = 60.0
    #: seconds to wait for the aggregator to answer at start
    connect_timeout: float = 30.0
    #: wire bytes per chunk; None: the transport's default (chunk_bytes_for)
    chunk_bytes: int | None = None
    window: int = DEFAULT_WINDOW
    #: shards of an embedded aggregator (None: one per core)
    embedded_shards: int | None = None
    #: switch protocol: the job's slice of the pool (the window, in packets);
    #: None: a host picks about 1 MiB in flight, a switch what its control
    #: plane installed
    slots: int | None = None
    #: switch protocol: int32 elements per packet (the switch's K); None:
    #: the aggregator's (a P4 switch: 64; a host: 2048, or what the path
    #: MTU fits)
    elements: int | None = None
    #: switch protocol: UDP batching (gso, mmsg, plain); None: the best the
    #: kernel offers
    udp_io: str | None = None
    #: the job's key (hex): JOINs are signed with it (None: unsigned, which
    #: only an aggregator without keys accepts; the embedded one makes its own)
    job_key: str | None = field(default=None, repr=False)
    #: the service's ZeroMQ CURVE public key (Z85): encrypt and check the
    #: server over zmq+tcp
    server_key: str | None = None
    #: how aggnet.torch (the DDP hook, the process-group backend) sends
    #: float32 tensors when not told otherwise: "float32" (None), "int32",
    #: "fp16" or "bf16"
    codec: str | None = None
    #: a topology file (racks, their aggregators, the root): each rank finds
    #: its rack's aggregator in it; used when no address is given
    topology: str | None = None
    #: keep what a restarted aggregator needs to finish the all-reduces in
    #: flight (the caller's input until a round completes, each result
    #: until every worker has it), so that a shard restart costs a rejoin
    #: instead of a failed step; False saves that memory and copying
    resume: bool = True
    #: a failed all-reduce leaves the caller's buffer as it was given: each
    #: result overwrites elements only after saving them (one copy of the
    #: buffer per all-reduce, about a tenth of the time of a memory-bound
    #: all-reduce on one host). None: yes, except under aggnet.torch (the
    #: DDP hook, the process-group backend), where a failed step's
    #: gradients are thrown away, as with gloo and NCCL
    all_or_nothing: bool | None = None
    #: how a device (CUDA) buffer travels: "direct" (as it is: ucx:// only,
    #: which reads device memory itself) or "staged" (through pinned host
    #: memory, on every transport); None: direct where the NIC reads GPU
    #: memory (GPUDirect RDMA: nvidia_peermem and an RDMA device), else
    #: staged, which measured 2.3x faster on a host without it
    device_path: str | None = None
    #: the int32 codec on an aggregator service, for a buffer all-reduced
    #: under the same ``key`` every step (a DDP bucket): quantize it with
    #: the exponents its last round's results carried, one octave up,
    #: instead of agreeing them first (a round trip before every bucket);
    #: a chunk whose values outgrew them, or that they would quantize over
    #: 8x more coarsely than agreeing would, goes again with the agreed one.
    #: Every worker of a job must set it alike
    predict_scale: bool = True
    #: over shm://, a buffer in this process's shared memory
    #: (aggnet.shared_array, a GPU bucket's staging buffer) is read by the
    #: shards where it lies, and its results written there where nothing
    #: is restored; False copies it through the rings as any other
    share_buffers: bool = True
    #: the aggnet torch backend: what runs the collectives of CUDA tensors
    #: that aggnet does not carry (broadcast, all-gather, send and receive,
    #: all-to-all, the all-reduces it leaves): "gloo" (None; through host
    #: memory, whatever the placement, ranks sharing a GPU included) or
    #: "nccl" (NCCL's own paths, NVLink or RDMA, for FSDP2's all-gathers
    #: of parameters; one GPU per rank, as NCCL needs)
    cuda_delegate: str | None = None

    def __post_init__(self):
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")
        if self.connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be > 0 seconds, got {self.connect_timeout!r}")
        if self.chunk_bytes is not None and not (64 <= self.chunk_bytes <= MAX_MESSAGE_BYTES):
            raise ValueError(f"chunk_bytes must be between 64 B and {MAX_MESSAGE_BYTES >> 20} MiB (the largest message "
                             f"an aggregator takes), got {self.chunk_bytes!r}")
        if self.chunk_bytes is not None and self.chunk_bytes % 4:
            raise ValueError(f"chunk_bytes must be a multiple of 4, got {self.chunk_bytes!r}")
        if not (1 <= self.window <= 1024):
            raise ValueError(f"window must be between 1 and 1024 chunks, got {self.window!r}")
        if self.embedded_shards is not None and self.embedded_shards < 1:
            raise ValueError(f"embedded_shards must be >= 1, got {self.embedded_shards!r}")
        if self.slots is not None and not (1 <= self.slots <= 65536):
            raise ValueError(f"slots must be between 1 and 65536, got {self.slots!r}")
        if self.elements is not None and not (1 <= self.elements <= MAX_ELEMENTS):
            raise ValueError(f"elements must be between 1 and {MAX_ELEMENTS}, got {self.elements!r}")
        if self.udp_io not in (None, "gso", "mmsg", "plain"):
            raise ValueError(f"udp_io must be gso, mmsg or plain, got {self.udp_io!r}")
        if self.job_key is not None:
            from aggnet.protocol.keys import parse_key

            parse_key(self.job_key)
        if self.codec not in (None, "float32", "int32", "fp16", "bf16"):
            raise ValueError(f"codec must be float32, int32, fp16 or bf16, got {self.codec!r}")
        if self.device_path not in (None, "direct", "staged"):
            raise ValueError(f"device_path must be direct or staged, got {self.device_path!r}")
        if self.cuda_delegate not in (None, "gloo", "nccl"):
            raise ValueError(f"cuda_delegate must be gloo or nccl, got {self.cuda_delegate!r}")
        if self.server_key is not None and len(self.server_key) != 40:
            raise ValueError(f"server_key must be a 40-character Z85 CURVE public key, got {len(self.server_key)} "
                             f"characters")

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "ClientConfig":
        env = os.environ if environ is None else environ
        values: dict = {}
        if env.get("AGGNET_ADDRESS"):
            values["address"] = env["AGGNET_ADDRESS"]
        for key, name, conv in (
            ("timeout", "AGGNET_TIMEOUT", float),
            ("chunk_bytes", "AGGNET_CHUNK_BYTES", parse_size),
            ("window", "AGGNET_WINDOW", int),
            ("embedded_shards", "AGGNET_SHARDS", int),
            ("slots", "AGGNET_SLOTS", int),
            ("elements", "AGGNET_ELEMENTS", int),
            ("udp_io", "AGGNET_UDP_IO", str),
            ("job_key", "AGGNET_JOB_KEY", str),
            ("server_key", "AGGNET_SERVER_KEY", str),
            ("topology", "AGGNET_TOPOLOGY", str),
            ("codec", "AGGNET_CODEC", str),
            ("resume", "AGGNET_RESUME", _flag),
            ("all_or_nothing", "AGGNET_ALL_OR_NOTHING", _flag),
            ("device_path", "AGGNET_DEVICE_PATH", str),
            ("predict_scale", "AGGNET_PREDICT_SCALE", _flag),
            ("share_buffers", "AGGNET_SHARE_BUFFERS", _flag),
            ("cuda_delegate", "AGGNET_CUDA_DELEGATE", str),
        ):
            if env.get(name):
                try:
                    values[key] = conv(env[name])
                except ValueError as exc:
                    raise ValueError(f"{name}={env[name]!r}: {exc}") from None
        known = {f.name for f in fields(cls)}
        for k, v in overrides.items():
            if k not in known:
                raise TypeError(f"unknown ClientConfig setting {k!r}; known: {sorted(known)}")
            if v is not None:
                values[k] = v
        return cls(**values)

    def chunk_bytes_for(self, scheme: str, uplink_mbit: float | None = None) -> int:
        """``chunk_bytes`` where it is set; else the transport's default,
        halved while a chunk would take longer than UPLINK_CHUNK_SECONDS on
        an uplink of ``uplink_mbit`` to the root (a topology's ``[links]``),
        down to MIN_UPLINK_CHUNK_BYTES. Every worker of a job reads the same
        topology, so all cut their buffers alike."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        size = SHM_CHUNK_BYTES if scheme == "shm" else DEFAULT_CHUNK_BYTES
        if uplink_mbit:
            crosses = uplink_mbit * 1e6 / 8 * UPLINK_CHUNK_SECONDS
            while size > MIN_UPLINK_CHUNK_BYTES and size > crosses:
                size //= 2
        return size

    def replace(self, **changes) -> "ClientConfig":
        return replace(self, **changes)

    def for_torch(self) -> "ClientConfig":
        """This configuration as aggnet.torch uses it: a failed step is
        thrown away, so its buffers need not be restored unless asked."""
        return self if self.all_or_nothing is not None else replace(self, all_or_nothing=False)
