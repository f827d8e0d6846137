"""numba kernels that build and parse whole batches of switch-protocol
packets (docs/protocol.md), for the worker's client and the aggregator
host's switch mode alike.

Per-packet Python is what a batched datagram engine cannot hide, so every
loop over packets is here: the client builds each slot's next use (header
plus quantized big-endian payload, read straight from the caller's buffer)
and decodes results into the caller's buffer; packets to send are staged
contiguously so one GSO call carries many. Byte offsets come from the one
header definition in :mod:`aggnet.protocol.wire`, never written by hand,
and those of reused fields from :mod:`aggnet.protocol.messages`.

The kernels take their arrays grouped in named tuples (numba compiles a
field access to a plain load): a received :class:`Batch`, a client's
:class:`Window` of slots, one all-reduce's :class:`Task`, and return
what they found as tuples.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numba
import numpy as np

from aggnet.kernels.hot import hot

from aggnet.protocol import messages, wire
from aggnet.kernels import QUANT_BITS as _QUANT_BITS
from aggnet.kernels.cpu import _byteswap32, _dequantize, _quantize
from aggnet.protocol.wire import EXPONENT_NONFINITE, EXPONENT_ZERO, HEADER_SIZE, MAGIC, VERSION


def _offsets() -> dict:
    out, bit = {}, 0
    for name, bits in wire.HEADER_FIELDS:
        out[name] = bit // 8
        bit += bits
    assert bit == 8 * HEADER_SIZE
    return out


OFFSET = _offsets()
WIDTH = {name: bits // 8 for name, bits in wire.HEADER_FIELDS}


def field_at(view, name: str) -> tuple[int, int]:
    """(byte offset, bytes) of the header field that carries value ``name``
    of a :mod:`aggnet.protocol.messages` view, for :func:`put_field`."""
    f = view.FIELDS[name]
    return OFFSET[f], WIDTH[f]


O_MAGIC = OFFSET["magic"]
O_VERSION = OFFSET["version"]
O_TYPE = OFFSET["msg_type"]
O_FLAGS = OFFSET["flags"]
O_DTYPE = OFFSET["dtype"]
O_SENDER = OFFSET["sender"]
O_JOB = OFFSET["job_id"]
O_ROUND = OFFSET["round"]
O_INDEX = OFFSET["index"]
O_COUNT = OFFSET["count"]
O_EXPONENT = OFFSET["exponent"]
O_NEXT_EXPONENT = OFFSET["next_exponent"]
O_NSUM = OFFSET["nsum"]
O_WORLD = OFFSET["world"]
O_REF = OFFSET["ref"]
O_RESERVED = OFFSET["reserved"]
O_OFFSET = OFFSET["offset"]

T_PUSH = int(wire.MsgType.PUSH)
T_RESULT = int(wire.MsgType.RESULT)
T_PROBE = int(wire.MsgType.PROBE)
T_PROBE_OK = int(wire.MsgType.PROBE_OK)
T_ERROR = int(wire.MsgType.ERROR)
T_HEARTBEAT = int(wire.MsgType.HEARTBEAT)
F_VERSION = int(wire.Flag.VERSION)
F_RETRANSMIT = int(wire.Flag.RETRANSMIT)
F_UPLINK = int(wire.Flag.UPLINK)
D_INT32 = int(wire.DType.INT32)
QUANT_BITS = _QUANT_BITS  # the scale rule of aggnet.kernels.quant_shift
KIND_IDLE, KIND_PRIMING, KIND_DATA = 0, 1, 2
#: where a PROBE_OK carries the slot's state
PROBE_COUNT = field_at(messages.ProbeOk, "count")
PROBE_SEEN = field_at(messages.ProbeOk, "seen")
PROBE_TAG = field_at(messages.ProbeOk, "tag")
PROBE_WORLD = field_at(messages.ProbeOk, "world")

#: received datagrams: datagram i lies at arena[offsets[i]:offsets[i] +
#: lengths[i]] and came from sources[i] (an address key); ``count`` of them
Batch = namedtuple("Batch", "arena offsets lengths sources count")
#: a client's slots: each one's packet (header from ``template``, then
#: ``k`` values), and the use it carries (tag, whether its result is
#: outstanding, its kind and block)
Window = namedtuple("Window", "packets template k tags busy kind block")
#: one all-reduce: the caller's buffer (float32 quantized with ``wbits``
#: bits of headroom and ``exps`` block exponents, or int32), its blocks,
#: the slots it uses from ``first_slot``, its round and its priming
#: ``fingerprint``, whose sum holds ``world`` contributions
Task = namedtuple("Task", "buf_f buf_i quantized nelem wbits multiplier used blocks exps fingerprint world rnd "
                          "first_slot")
#: a client's send timers per slot (when its use went out, its timeout,
#: whether it went out once only, whether it was fast-resent, the results
#: seen and the older uses waiting when it went out), whether it waits,
#: its destination, and room for the ends of a batch's runs of slots
Pace = namedtuple("Pace", "sent_at rto first_try fast_done results_at_send older_at_send busy slot_dest runs")
#: which results a client takes: from the aggregator's ports
#: ``src_lo..src_hi``, for its job and slots, of ``packet_bytes``
Accept = namedtuple("Accept", "src_lo src_hi job_id slots packet_bytes")
#: where classify_results puts what it took: each result's slot and
#: arena offset, and the probe answers' offsets
Taken = namedtuple("Taken", "slot offset probe")

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_inline = numba.njit(cache=True, nogil=True, inline="always")


@_inline
def be16(p, o):
    return (np.int32(p[o]) << 8) | np.int32(p[o + 1])


@_inline
def be32(p, o):
    return (np.uint32(p[o]) << np.uint32(24)) | (np.uint32(p[o + 1]) << np.uint32(16)) | \
        (np.uint32(p[o + 2]) << np.uint32(8)) | np.uint32(p[o + 3])


@_inline
def put16(p, o, v):
    v = np.int32(v) & 0xFFFF
    p[o] = np.uint8(v >> 8)
    p[o + 1] = np.uint8(v & 0xFF)


@_inline
def put32(p, o, v):
    v = np.uint32(v)
    p[o] = np.uint8(v >> np.uint32(24))
    p[o + 1] = np.uint8((v >> np.uint32(16)) & np.uint32(0xFF))
    p[o + 2] = np.uint8((v >> np.uint32(8)) & np.uint32(0xFF))
    p[o + 3] = np.uint8(v & np.uint32(0xFF))


@_inline
def put64(p, o, v):
    v = np.uint64(v)
    put32(p, o, np.uint32(v >> np.uint64(32)))
    put32(p, o + 4, np.uint32(v & np.uint64(0xFFFFFFFF)))


@_inline
def put_field(p, at, v):
    """Write ``v`` big-endian into the field ``at`` (see :func:`field_at`)."""
    o, n = at
    v = np.uint64(v)
    for b in range(n):
        p[o + n - 1 - b] = np.uint8((v >> np.uint64(8 * b)) & np.uint64(0xFF))


@_inline
def s16(v):
    return v - 65536 if v >= 32768 else v


@_inline
def bswap(v):
    v = np.uint32(v)
    return np.uint32(((v & np.uint32(0xFF)) << np.uint32(24)) | ((v & np.uint32(0xFF00)) << np.uint32(8))
                     | ((v >> np.uint32(8)) & np.uint32(0xFF00)) | (v >> np.uint32(24)))


@_inline
def shard_delta(base, shard_slots, index):
    """Which of a sharded peer's consecutive ports serves ``index`` of a
    slice starting at ``base`` of its pool (0 for a peer with one port)."""
    if shard_slots <= 0:
        return 0
    return (base + np.int64(index)) // shard_slots


# the element loops are the CPU backend's kernels (checked against the
# NumPy reference), called on contiguous slices: LLVM vectorizes them
# there, and not once inlined into the packet loops


@_inline
def _next_tag(tags, s):
    """The slot's next use: its tag counts up, skipping 0 (never used)."""
    t = tags[s] + np.uint32(1)
    if t == 0:
        t = np.uint32(1)
    tags[s] = t
    return t


# -- the worker's side -------------------------------------------------------------------


@hot
@_jit
def classify_results(batch, accept, window, taken):
    """Pick the results that answer an outstanding use (right source,
    job, slot, tag and size) out of a received batch; mark their slots
    idle. Returns (results, probes, dropped): results and probe answers go
    to ``taken``, and so do the aggregator's ERRORs about the job (a verdict
    it tells every member) and its heartbeat echoes (the caller reads the
    type of each); dropped counts what
    came from elsewhere or is malformed (not duplicates)."""
    m = 0
    probes = 0
    dropped = 0
    for i in range(batch.count):
        if batch.sources[i] < accept.src_lo or batch.sources[i] > accept.src_hi:
            dropped += 1
            continue
        length = batch.lengths[i]
        if length < HEADER_SIZE:
            dropped += 1
            continue
        o = batch.offsets[i]
        p = batch.arena[o:o + length]
        if be16(p, O_MAGIC) != MAGIC or p[O_VERSION] != VERSION or be32(p, O_JOB) != accept.job_id:
            dropped += 1
            continue
        index = be32(p, O_INDEX)
        if index >= np.uint32(accept.slots):
            dropped += 1
            continue
        t = p[O_TYPE]
        if t == T_PROBE_OK or t == T_ERROR or t == T_HEARTBEAT:
            if (length == HEADER_SIZE or t == T_ERROR) and probes < taken.probe.size:
                taken.probe[probes] = o
                probes += 1
            else:
                dropped += 1
            continue
        if t != T_RESULT or length != accept.packet_bytes or p[O_DTYPE] != D_INT32:
            dropped += 1
            continue
        s = np.int64(index)
        if not window.busy[s] or be32(p, O_REF) != window.tags[s]:
            continue  # a duplicate result, or one for an older use
        window.busy[s] = False
        taken.slot[m] = s
        taken.offset[m] = o
        m += 1
    return m, probes, dropped


@_inline
def _build_use(window, task, s, kind, block, exponent, next_exponent, tag):
    """Write slot ``s``'s packet for a use: header from the template, then
    the block's payload (quantized with the agreed exponent, big-endian)."""
    p = window.packets[s]
    k = window.k
    for b in range(HEADER_SIZE):
        p[b] = window.template[b]
    p[O_FLAGS] = np.uint8(F_VERSION if tag & np.uint32(1) else 0)
    put32(p, O_ROUND, task.rnd)
    put32(p, O_INDEX, s)
    put32(p, O_REF, tag)
    start = block * k
    if kind == KIND_PRIMING:
        put16(p, O_EXPONENT, 0)
        put16(p, O_NEXT_EXPONENT, next_exponent)
        put64(p, O_OFFSET, 0)
        for b in range(HEADER_SIZE, HEADER_SIZE + 4 * k):
            p[b] = 0
        return
    put16(p, O_EXPONENT, exponent)
    put16(p, O_NEXT_EXPONENT, next_exponent)
    put64(p, O_OFFSET, start)
    n = min(k, task.nelem - start)
    payload = p[HEADER_SIZE:HEADER_SIZE + 4 * k].view(np.uint32)
    if task.quantized:
        _quantize(task.buf_f[start:start + n], math.ldexp(1.0, QUANT_BITS - exponent - task.wbits), payload[:n], True)
    else:
        _byteswap32(task.buf_i[start:start + n].view(np.uint32), payload[:n])
    for e in range(n, k):
        payload[e] = 0


@hot
@_jit
def start_uses(window, task, slots_in, count):
    """The first use of each slot in ``slots_in[:count]`` for a task: a
    priming use. It carries the task's fingerprint (its size, whether
    quantized), which the sum shows all workers agree on, and, quantized,
    the exponent of the slot's first block."""
    slots_total = window.tags.size
    for i in range(count):
        s = slots_in[i]
        pos = (s - task.first_slot) % slots_total
        t = _next_tag(window.tags, s)
        window.busy[s] = True
        window.block[s] = pos
        window.kind[s] = KIND_PRIMING
        _build_use(window, task, s, KIND_PRIMING, pos, 0, task.exps[pos] if task.quantized else 0, t)
        for e in range(task.fingerprint.size):
            put32(window.packets[s], HEADER_SIZE + 4 * e, task.fingerprint[e])


def fingerprint(nelem: int, quantized: bool, k: int) -> np.ndarray:
    """A request's priming payload: each byte d of its size (and a byte for
    the encoding) as d and d*d. Summed over W workers these equal W*d and
    W*d*d on every byte only when every worker sent the same d (equality in
    Cauchy-Schwarz), so a switch that only adds tells every worker whether
    the buffers agree. Fits the first 18 values of a packet (fewer bytes,
    the low ones, when K is smaller)."""
    data = list(int(nelem).to_bytes(8, "little")) + [1 if quantized else 0]
    n = min(len(data), k // 2)
    out = np.empty(2 * n, np.int32)
    for i in range(n):
        out[2 * i], out[2 * i + 1] = data[i], data[i] * data[i]
    return out


@_inline
def _fingerprint_agrees(p, task):
    """Whether a priming sum holds ``world`` equal fingerprints."""
    for e in range(task.fingerprint.size):
        if np.int64(np.int32(be32(p, HEADER_SIZE + 4 * e))) != np.int64(task.fingerprint[e]) * task.world:
            return False
    return True


@hot
@_jit
def advance(arena, res_slot, res_off, m, window, task, next_slots, finished):
    """Take ``m`` results of one task: decode data results into the
    caller's buffer, and build each slot's next use of the task into
    ``next_slots``; slots with nothing left in it go to ``finished``.
    Returns (next uses built, slots finished, first block after a NaN/Inf
    marker or -1, whether a priming sum shows the workers' buffers
    differ).

    One loop over the window's and task's arrays, taken out of their
    tuples once: as helpers taking the tuples, the same steps cost the
    client about a sixth more CPU per byte at 64 values a packet."""
    packets, template, k, tags, busy, kinds, blocks_of = window
    quantized, nelem, wbits, used, nblocks, exps = task.quantized, task.nelem, task.wbits, task.used, task.blocks, \
        task.exps
    buf_f, buf_i = task.buf_f, task.buf_i
    scale_in = task.multiplier
    nn = 0
    nf = 0
    nonfinite = -1
    differ = False
    for i in range(m):
        s = res_slot[i]
        p = arena[res_off[i]:res_off[i] + HEADER_SIZE + 4 * k]
        b = blocks_of[s]
        if kinds[s] == KIND_PRIMING and not _fingerprint_agrees(p, task):
            differ = True
        nb = b
        if kinds[s] == KIND_DATA:
            start = b * k
            n = min(k, nelem - start)
            payload = p[HEADER_SIZE:HEADER_SIZE + 4 * k].view(np.uint32)
            if quantized:
                e = s16(be16(p, O_EXPONENT))
                _dequantize(payload[:n], math.ldexp(1.0, -(QUANT_BITS - e - wbits)) * scale_in,
                            buf_f[start:start + n], True)
            else:
                _byteswap32(payload[:n], buf_i[start:start + n].view(np.uint32))
            nb = b + used
        kinds[s] = KIND_IDLE
        if nb >= nblocks:
            finished[nf] = s
            nf += 1
            continue
        agreed = 0
        if quantized:
            agreed = s16(be16(p, O_NEXT_EXPONENT))
            if agreed == EXPONENT_NONFINITE:
                # every worker got the marker: all stop this slot's blocks
                if nonfinite < 0 or nb < nonfinite:
                    nonfinite = nb
                finished[nf] = s
                nf += 1
                continue
        # the slot's next use: block nb, quantized with the agreed
        # exponent, proposing the exponent of the block it carries after it
        after = nb + used
        nxt = EXPONENT_ZERO
        if quantized and after < nblocks:
            nxt = exps[after]
        t = _next_tag(tags, s)
        busy[s] = True
        kinds[s] = KIND_DATA
        blocks_of[s] = nb
        _build_use(window, task, s, KIND_DATA, nb, agreed, nxt, t)
        next_slots[nn] = s
        nn += 1
    return nn, nf, nonfinite, differ


@hot
@_jit
def stage(packets, slots_in, count, staging, packet_bytes, retransmit):
    """Copy the packets of ``slots_in[:count]`` one after another into
    ``staging`` (one GSO send carries a run of them)."""
    for i in range(count):
        s = slots_in[i]
        if retransmit:
            packets[s, O_FLAGS] |= np.uint8(F_RETRANSMIT)
        base = i * packet_bytes
        for b in range(packet_bytes):
            staging[base + b] = packets[s, b]


@hot
@_jit
def note_sends(pace, slots, n, now, fresh, base_rto, results_seen, sharded):
    """Time the sends of ``slots[:n]`` at ``now`` (``fresh``: their uses'
    first sends, which also start their timers and fast-retransmission
    counts), and write to ``pace.runs`` where each run of consecutive slots
    (of one destination, when ``sharded``) ends; returns the runs' count.
    One call where the bookkeeping took a dozen numpy calls per batch."""
    if fresh:
        older = 0
        for s in range(pace.busy.size):
            if pace.busy[s]:
                older += 1
        for i in range(n):
            s = slots[i]
            pace.rto[s] = base_rto
            pace.first_try[s] = True
            pace.fast_done[s] = False
            pace.results_at_send[s] = results_seen
            # the whole batch counts as older: its packets come back in any order
            pace.older_at_send[s] = older
    runs = 0
    for i in range(n):
        s = slots[i]
        pace.sent_at[s] = now
        if i > 0:
            prev = slots[i - 1]
            if s != prev + 1 or (sharded and pace.slot_dest[s] != pace.slot_dest[prev]):
                pace.runs[runs] = i
                runs += 1
    pace.runs[runs] = n
    return runs + 1


@hot
@_jit
def look_at_results(pace, rid, slots, m, none):
    """Of the results for ``slots[:m]``: when the middle one of those whose
    use went out once only was sent (an RTT sample; ``none`` if no such
    one), and the one request all of them serve (``none`` if several)."""
    clean = 0
    for i in range(m):
        if pace.first_try[slots[i]]:
            clean += 1
    sent = none
    if clean:
        want, seen = clean // 2, 0
        for i in range(m):
            if pace.first_try[slots[i]]:
                if seen == want:
                    sent = pace.sent_at[slots[i]]
                    break
                seen += 1
    one = rid[slots[0]]
    for i in range(1, m):
        if rid[slots[i]] != one:
            return sent, none
    return sent, float(one)
