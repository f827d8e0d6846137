"""Sparse tables on an aggregator shard: the parameter-server half of
aggnet's hybrid (Parallax: dense variables are all-reduced, sparse ones are
best served by a parameter server, 4αwm(N-1)/N bytes per machine and step
against 2αwm(N-1) for an all-gather).

A table is cut into row partitions (:mod:`aggnet.protocol.sparse_layout`); this
shard holds the partitions that fall to it, and nothing here is shared with
another shard. Workers push the gradient rows of a round to every partition
(an empty push where they touched none), and a round completes on a
partition once all its ``pushers`` pushed it: every worker, or one per host
when the workers of a host combine their rows first
(:mod:`aggnet.client.host_group`); the contributions are then summed in rank
order, so every worker and every rerun gets the same bits. The answer goes
to every worker that opened the table.

* ``allreduce`` tables hold no rows: a complete round's sum goes back to
  every worker (the DDP hook's sparse buckets; the worker's own optimizer
  then steps).
* ``ps`` tables hold the rows and the optimizer state (SGD, SGD with
  momentum, Adagrad, lazy Adam, or a plain sum): a complete round is
  applied, then every worker hears an empty acknowledgement, after which
  its pulls see the new rows.

Storage is preallocated when a table is created (zeroed pages cost nothing
until written) and counted, with the round buffers, against one bound per
shard: ``AGGNET_SPARSE_MEMORY`` bytes (suffix K, M, G accepted), a quarter
of the host's memory by default. Anything past it is refused with an error
that says so, and changes nothing. A malformed or refused message is
dropped, counted (``dropped_sparse_<why>``) and answered with an ERROR.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np

from aggnet.protocol import control, sparse_layout, wire
from aggnet.protocol.control import ControlError
from aggnet.protocol.wire import DType, ErrorCode, Flag, Header, MsgType

log = logging.getLogger("aggnet.hosts.sparse")

#: message types this module serves (the shard's dispatch sends them here)
MESSAGES = frozenset({MsgType.TABLE, MsgType.SPARSE_PUSH, MsgType.SPARSE_PULL, MsgType.SPARSE_LOAD})
MODES = ("ps", "allreduce")
OPS = ("sum", "avg")
#: optimizer -> its per-row state slots after the weights (slot 0)
OPTIMIZERS = {"sum": (), "sgd": (), "momentum": ("momentum",), "adagrad": ("sum",),
              "adam": ("exp_avg", "exp_avg_sq")}
INITS = ("zeros", "normal", "uniform")
#: rounds a partition keeps open while waiting for slow workers; past it
#: the oldest is given up (its contributors hear why)
MAX_OPEN_ROUNDS = 16
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def memory_bound() -> int:
    """Bytes this shard's tables may use (``AGGNET_SPARSE_MEMORY``)."""
    text = os.environ.get("AGGNET_SPARSE_MEMORY", "").strip().upper()
    if text:
        try:
            mult = _SUFFIX.get(text[-1], 1)
            value = int(float(text[:-1] if text[-1] in _SUFFIX else text) * mult)
            if value > 0:
                return value
        except ValueError:
            pass
        log.warning("AGGNET_SPARSE_MEMORY=%r is not a byte count (like 512M or 8G); using the default", text)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 4 << 30


@dataclass(eq=False)
class Partition:
    index: int
    lo: int
    hi: int
    #: weights, then the optimizer's state slots (none in all-reduce mode)
    slots: list = field(default_factory=list)
    #: optimizer steps applied (Adam's bias correction, Adagrad's decay)
    step: int = 0
    #: the last round that completed here
    done: int = 0
    #: round -> {rank: (indices, rows)} while waiting for every worker
    rounds: dict = field(default_factory=dict)


@dataclass(eq=False)
class Table:
    job_id: int
    table_id: int
    job: str
    name: str
    rows: int
    width: int
    partitions: int
    mode: str
    op: str
    optimizer: dict
    init: dict | None
    world: int
    #: contributions a round waits for: ``world``, or the number of hosts
    #: when the workers of a host combine their rows before the network
    pushers: int = 0
    parts: dict = field(default_factory=dict)  #: partition -> Partition (this shard's)
    members: dict = field(default_factory=dict)  #: rank -> transport peer
    pushing: set = field(default_factory=set)  #: ranks that push their (host's) rows
    nbytes: int = 0  #: preallocated storage
    pending: int = 0  #: bytes held in open rounds

    def spec(self) -> tuple:
        return (self.rows, self.width, self.partitions, self.mode, self.op, self.optimizer, self.init,
                self.pushers)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def init_rows(init: dict | None, lo: int, hi: int, width: int) -> np.ndarray | None:
    """Initial values of rows lo..hi-1: a hash of (seed, row, column), so a
    row's value is the same whatever the partitioning (None: zeros)."""
    if init is None or init["kind"] == "zeros":
        return None
    cells = (np.arange(lo, hi, dtype=np.uint64)[:, None] * np.uint64(width)
             + np.arange(width, dtype=np.uint64)[None, :])
    x = _splitmix64(cells ^ _splitmix64(np.full(1, init["seed"], np.uint64)))
    u1 = (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    scale = init["scale"]
    if init["kind"] == "uniform":
        return ((2.0 * u1 - 1.0) * scale).astype(np.float32)
    u2 = (_splitmix64(x) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return (np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2) * scale).astype(np.float32)


def apply_optimizer(table: Table, part: Partition, rows: np.ndarray, g: np.ndarray, divisor: int = 1) -> None:
    """One optimizer step on the partition's ``rows`` (local, unique) with
    gradient ``g / divisor`` (a round's average: ``g`` is overwritten): the
    NumPy forms of torch's sparse updates (SGD, Adagrad, SparseAdam), lazy
    momentum as TensorFlow's sparse momentum (only touched rows move).

    The rows are stepped a block at a time (128 KiB of them): a block's
    gathered rows and temporaries stay in cache between the division, the
    gather, the arithmetic and the scatter, where a whole step's go out to
    memory and back at each. Every element goes through the same float32
    operations either way, so the bits do not change."""
    opt = table.optimizer
    name = opt["name"]
    part.step += 1
    w = part.slots[0]
    lr = np.float32(opt["lr"])
    if name == "adagrad":
        clr = np.float32(opt["lr"] / (1 + (part.step - 1) * opt["lr_decay"]))
        eps = np.float32(opt["eps"])
    elif name == "adam":
        b1, b2 = opt["beta1"], opt["beta2"]
        bc1 = 1 - b1 ** part.step
        bc2 = 1 - b2 ** part.step
        step_size = np.float32(-(opt["lr"] * np.sqrt(bc2) / bc1))
        eps = np.float32(opt["eps"])
    block = max(1, (128 << 10) // (4 * table.width))
    gathered = np.empty((min(block, rows.size), table.width), np.float32)
    for a in range(0, rows.size, block):
        r, gb = rows[a:a + block], g[a:a + block]
        if divisor != 1:
            np.divide(gb, np.float32(divisor), out=gb)
        if name in ("sum", "sgd"):
            # w[r] += g and w[r] -= lr * g without their temporaries (the
            # rows are checked: "clip" never clips)
            wr = gathered[:r.size]
            np.take(w, r, axis=0, out=wr, mode="clip")
            if name == "sgd":
                np.multiply(gb, lr, out=gb)
                np.subtract(wr, gb, out=wr)
            else:
                np.add(wr, gb, out=wr)
            w[r] = wr
        elif name == "momentum":
            m = part.slots[1]
            buf = np.float32(opt["momentum"]) * m[r] + gb
            m[r] = buf
            w[r] -= lr * buf
        elif name == "adagrad":
            s = part.slots[1]
            acc = s[r] + gb * gb
            s[r] = acc
            w[r] -= clr * (gb / (np.sqrt(acc) + eps))
        elif name == "adam":
            m, v = part.slots[1], part.slots[2]
            m_old, v_old = m[r], v[r]
            m_upd = (gb - m_old) * np.float32(1 - b1)
            v_upd = (gb * gb - v_old) * np.float32(1 - b2)
            m[r] = m_old + m_upd
            v[r] = v_old + v_upd
            numer = m_upd + m_old
            denom = np.sqrt(v_upd + v_old) + eps
            w[r] += step_size * (numer / denom)


class SparseTables:
    """The sparse tables of one shard."""

    def __init__(self, shard):
        self.shard = shard
        self.tables: dict[tuple[int, int], Table] = {}
        self.bound = memory_bound()
        self.used = 0

    @property
    def counters(self):
        return self.shard.counters

    # -- messages --------------------------------------------------------------------

    def handle(self, peer, h: Header, payload) -> None:
        try:
            if h.msg_type == MsgType.TABLE:
                self._on_table(peer, h, payload)
            elif h.msg_type == MsgType.SPARSE_PUSH:
                self._on_push(peer, h, payload)
            elif h.msg_type == MsgType.SPARSE_PULL:
                self._on_pull(peer, h, payload)
            elif h.msg_type == MsgType.SPARSE_LOAD:
                self._on_load(peer, h, payload)
        except ControlError as exc:
            self._refuse(peer, h, exc.reason, exc.code, str(exc))

    def _answer(self, peer, h: Header, msg_type: MsgType, payload: bytes = b"", n: int = 0,
                sender: int | None = None) -> None:
        # every field of the request comes back, and its type in
        # ``exponent``: the worker matches answers by them
        out = Header(msg_type, job_id=h.job_id, round=h.round, index=h.index,
                     sender=h.sender if sender is None else sender, flags=Flag.LITTLE_ENDIAN, dtype=DType.NONE,
                     exponent=int(h.msg_type), nsum=h.nsum, world=h.world, ref=n, offset=h.offset)
        if not self.shard.listener.send(peer, out.pack_for(payload), payload or None):
            self.counters["send_unreachable"] += 1
        else:
            self.counters["sparse_bytes_out"] += len(payload)

    def _refuse(self, peer, h: Header, reason: str, code: ErrorCode, text: str) -> None:
        self.counters[f"dropped_sparse_{reason}"] += 1
        log.debug("shard %d refused a %s: %s", self.shard.index, h.msg_type.name, text)
        self._answer(peer, h, MsgType.ERROR, wire.error_payload(code, text))

    # -- tables ----------------------------------------------------------------------

    def _on_table(self, peer, h: Header, payload) -> None:
        info = control.parse(control.TABLE, payload, "TABLE")
        name = info["table"]
        if h.world < 1 or h.sender >= h.world:
            raise ControlError(ErrorCode.REFUSED, f"rank {h.sender} is outside world size {h.world}", "bad_table")
        self.shard.keyring.verify("TABLE", h.job_id, h.sender, h.world, info["job"], info, peer)
        if h.index != sparse_layout.table_id(name):
            raise ControlError(ErrorCode.MALFORMED, f"header names table id {h.index:08x}, but table "
                                                               f"{name!r} has id {sparse_layout.table_id(name):08x}", "table_id")
        key = (h.job_id, h.index)
        table = self.tables.get(key)
        if info["close"]:
            if table is not None and table.members.get(h.sender) == peer:
                del table.members[h.sender]
                if not table.members:
                    self._free(table)
            self._answer(peer, h, MsgType.TABLE_OK, wire.json_payload({"table": name, "closed": True}))
            return
        self._check_choices(info)
        info["optimizer"].setdefault("eps", 1e-10 if info["optimizer"]["name"] == "adagrad" else 1e-8)
        if info["shards"] <= self.shard.index:
            raise ControlError(ErrorCode.MALFORMED, f"TABLE says the service has {info['shards']} "
                                                                    f"shard(s), but this is shard {self.shard.index}", "field_shards")
        init = info.get("init")
        info.setdefault("pushers", h.world)
        if info["pushers"] > h.world:
            raise ControlError(ErrorCode.MALFORMED, f"TABLE says {info['pushers']} ranks push each round, more than the {h.world} "
                              f"workers of the job", "field_pushers")
        if table is None:
            table = self._create(h, info, init)
        elif table.name != name or table.job != info["job"]:
            raise ControlError(ErrorCode.JOB_MISMATCH, f"table id {h.index:08x} of this job belongs to table {table.name!r} of job "
                              f"{table.job!r}; choose another table name", "table_clash")
        elif table.world != h.world:
            raise ControlError(ErrorCode.JOB_MISMATCH, f"table {name!r} is open with world size {table.world}, rank {h.sender} opened it "
                              f"with world size {h.world}; all workers must agree", "world_mismatch")
        else:
            want = Table(0, 0, "", "", info["rows"], info["width"], info["partitions"], info["mode"], info["op"],
                         info["optimizer"], init, h.world, info["pushers"])
            if want.spec() != table.spec():
                raise ControlError(ErrorCode.JOB_MISMATCH, f"table {name!r} exists as {_describe(table)}; rank {h.sender} asked for "
                                  f"{_describe(want)}; every worker must open it alike", "spec_mismatch")
        pushing = table.pushing | {h.sender} if info["pusher"] else table.pushing - {h.sender}
        if len(pushing) > table.pushers:
            raise ControlError(ErrorCode.JOB_MISMATCH, f"table {name!r} takes pushes from {table.pushers} rank(s) per round (one per host "
                              f"when workers combine their rows), but ranks {sorted(pushing)} say they push; give "
                              f"every worker of a host the same host group", "pushers")
        old = table.members.get(h.sender)
        if old is not None and old != peer:
            self.counters["sparse_reopens"] += 1
        table.members[h.sender] = peer
        table.pushing = pushing
        self.counters["sparse_opens"] += 1
        self._answer(peer, h, MsgType.TABLE_OK, wire.json_payload({
            "table": name, "shard": self.shard.index, "partitions": sorted(table.parts),
            "steps": {str(p): part.step for p, part in table.parts.items()},
            "done": {str(p): part.done for p, part in table.parts.items()},
            "bytes": table.nbytes, "memory_used": self.used, "memory_bound": self.bound}))

    @staticmethod
    def _check_choices(info) -> None:
        for what, value, allowed in (("mode", info["mode"], MODES), ("op", info["op"], OPS),
                                     ("optimizer.name", info["optimizer"]["name"], tuple(OPTIMIZERS)),
                                     ("init.kind", (info.get("init") or {"kind": "zeros"})["kind"], INITS)):
            if value not in allowed:
                raise ControlError(ErrorCode.MALFORMED, f"field {what!r} must be one of {list(allowed)}, got {value!r}", f"field_{what.split('.')[0]}")

    def _create(self, h: Header, info, init) -> Table:
        table = Table(h.job_id, h.index, info["job"], info["table"], info["rows"], info["width"],
                      info["partitions"], info["mode"], info["op"], info["optimizer"], init, h.world,
                      info["pushers"])
        if table.partitions > table.rows:
            raise ControlError(ErrorCode.MALFORMED, f"{table.partitions} partitions of a table of {table.rows} rows would leave some "
                              f"empty; use at most {table.rows}", "field_partitions")
        edges = sparse_layout.bounds(table.rows, table.partitions)
        mine = [p for p in range(table.partitions) if sparse_layout.shard_of(p, info["shards"]) == self.shard.index]
        nslots = 1 + len(OPTIMIZERS[table.optimizer["name"]]) if table.mode == "ps" else 0
        need = sum(int(edges[p + 1] - edges[p]) for p in mine) * table.width * 4 * nslots
        if self.used + need > self.bound:
            raise ControlError(ErrorCode.REFUSED, f"table {table.name!r} ({_describe(table)}) needs {need} bytes on shard "
                              f"{self.shard.index} for {len(mine)} of its partitions; this shard's sparse tables may "
                              f"use {self.bound} bytes and {self.used} are in use: spread it over more shards "
                              f"(aggnet serve --shards) or hosts, or raise AGGNET_SPARSE_MEMORY", "memory")
        for p in mine:
            lo, hi = int(edges[p]), int(edges[p + 1])
            part = Partition(p, lo, hi)
            if nslots:
                weights = np.zeros((hi - lo, table.width), np.float32)
                for start in range(0, hi - lo, sparse_layout.block_rows(table.width)):
                    stop = min(hi - lo, start + sparse_layout.block_rows(table.width))
                    values = init_rows(init, lo + start, lo + stop, table.width)
                    if values is not None:
                        weights[start:stop] = values
                part.slots.append(weights)
                for slot in OPTIMIZERS[table.optimizer["name"]]:
                    fill = table.optimizer["initial_accumulator_value"] if slot == "sum" else 0.0
                    part.slots.append(np.full((hi - lo, table.width), fill, np.float32))
            table.parts[p] = part
        table.nbytes = need
        self.used += need
        self.tables[(table.job_id, table.table_id)] = table
        log.info("shard %d: sparse table %r of job %r (%s) holds partitions %s (%d bytes)", self.shard.index,
                 table.name, table.job, _describe(table), mine, need)
        return table

    def _free(self, table: Table) -> None:
        self.used -= table.nbytes + table.pending
        self.tables.pop((table.job_id, table.table_id), None)
        log.info("shard %d: sparse table %r of job %r closed by every worker", self.shard.index, table.name,
                 table.job)

    def _locate(self, peer, h: Header) -> tuple[Table, Partition]:
        table = self.tables.get((h.job_id, h.index))
        if table is None:
            raise ControlError(ErrorCode.NOT_JOINED, f"table id {h.index:08x} of job id {h.job_id:08x} does not exist on shard "
                              f"{self.shard.index}; open it first (SparseClient.table) with the same name", "unknown_table")
        if table.members.get(h.sender) != peer:
            raise ControlError(ErrorCode.NOT_JOINED, f"rank {h.sender} has not opened table {table.name!r} from this connection", "not_member")
        part = table.parts.get(h.offset)
        if part is None:
            raise ControlError(ErrorCode.MALFORMED, f"table {table.name!r} has no partition {h.offset} on shard {self.shard.index} "
                              f"(it holds {sorted(table.parts)} of {table.partitions})", "partition")
        return table, part

    @staticmethod
    def _check_range(table: Table, part: Partition, idx: np.ndarray) -> None:
        if idx.size == 0 or (idx.min() >= part.lo and idx.max() < part.hi):
            return
        outside = (idx < part.lo) | (idx >= part.hi)
        if outside.any():
            bad = int(idx[np.argmax(outside)])
            where = (f"outside the table's rows [0, {table.rows})" if not 0 <= bad < table.rows else
                     f"in another partition than {part.index} (rows {part.lo}..{part.hi - 1})")
            raise ControlError(ErrorCode.MALFORMED, f"row index {bad} of table {table.name!r} is {where}; {int(outside.sum())} of "
                              f"{idx.size} indices are; nothing was changed", "out_of_range")

    def _rows_of(self, table: Table, part: Partition, h: Header, payload, width: int | None):
        try:
            idx, rows = sparse_layout.unpack_rows(payload, h.ref, width)
        except ValueError as exc:
            raise ControlError(ErrorCode.MALFORMED, f"{h.msg_type.name} to table {table.name!r} "
                                                           f"partition {part.index}: {exc}; nothing was changed", "width")
        self._check_range(table, part, idx)
        if rows is not None and not np.isfinite(rows).all():
            raise ControlError(ErrorCode.MALFORMED, f"{h.msg_type.name} to table {table.name!r} holds NaN/Inf values; nothing was changed", "nonfinite")
        return idx, rows

    # -- rounds ----------------------------------------------------------------------

    def _on_push(self, peer, h: Header, payload) -> None:
        table, part = self._locate(peer, h)
        if h.sender not in table.pushing:
            raise ControlError(ErrorCode.REFUSED, f"rank {h.sender} opened table {table.name!r} as a worker whose rows its host's "
                              f"first worker combines and pushes; it cannot push itself", "not_pusher")
        idx, rows = self._rows_of(table, part, h, payload, table.width)
        if h.round <= part.done:
            raise ControlError(ErrorCode.REFUSED, f"round {h.round} of table {table.name!r} partition "
                                                         f"{part.index} is finished (the last was {part.done})", "late")
        pending = part.rounds.setdefault(h.round, {})
        if h.sender in pending:
            raise ControlError(ErrorCode.REFUSED, f"rank {h.sender} pushed round {h.round} of table "
                                                              f"{table.name!r} partition {part.index} twice", "duplicate")
        nbytes = idx.nbytes + rows.nbytes
        if self.used + nbytes > self.bound:
            if not pending:
                del part.rounds[h.round]
            raise ControlError(ErrorCode.REFUSED, f"holding round {h.round} of table {table.name!r} needs {nbytes} more bytes; shard "
                              f"{self.shard.index} is at {self.used} of its {self.bound}-byte bound "
                              f"(AGGNET_SPARSE_MEMORY)", "memory")
        # the payload may be the transport's memory, valid until its next
        # receive: rows that wait for other ranks are copied; the last
        # pusher's complete the round now, straight from the payload
        last = len(pending) + 1 == table.pushers
        pending[h.sender] = (idx, rows) if last else (idx.copy(), rows.copy())
        self.used += nbytes
        table.pending += nbytes
        self.counters["sparse_pushes"] += 1
        self.counters["sparse_bytes_in"] += len(payload)
        if len(pending) == table.pushers:
            self._complete(table, part, h)
        elif len(part.rounds) > MAX_OPEN_ROUNDS:
            self._abandon(table, part, min(part.rounds), f"{MAX_OPEN_ROUNDS} later rounds are open")

    def _complete(self, table: Table, part: Partition, h: Header) -> None:
        pending = part.rounds.pop(h.round)
        contributions = [pending[r] for r in sorted(pending)]
        nbytes = sum(i.nbytes + v.nbytes for i, v in contributions)
        self.used -= nbytes
        table.pending -= nbytes
        # in rank order: each row's contributions are added in that order,
        # so every worker and every rerun gets the same bits; an all-reduce
        # round's sums are made inside the answer's payload
        ps = table.mode == "ps"
        uniq, summed, payload = sparse_layout.combine_parts(contributions, table.width, packed=not ps)
        del pending, contributions
        divisor = table.world if table.op == "avg" else 1
        if divisor != 1 and not ps:
            summed /= np.float32(divisor)
        part.done = h.round
        self.counters["sparse_rounds"] += 1
        if ps:
            apply_optimizer(table, part, uniq - part.lo, summed, divisor)
            payload, n = b"", 0
        else:
            n = uniq.size
        for rank, peer in table.members.items():
            self._answer(peer, h, MsgType.SPARSE_ROWS, payload, n, sender=rank)
        for r in [r for r in part.rounds if r < h.round]:
            self._abandon(table, part, r, f"round {h.round} completed without it")

    def _abandon(self, table: Table, part: Partition, rnd: int, why: str) -> None:
        pending = part.rounds.pop(rnd)
        nbytes = sum(i.nbytes + v.nbytes for i, v in pending.values())
        self.used -= nbytes
        table.pending -= nbytes
        self.counters["sparse_rounds_abandoned"] += 1
        missing = [r for r in sorted(table.pushing) if r not in pending]
        text = (f"round {rnd} of table {table.name!r} partition {part.index} was given up ({why}): rank(s) "
                f"{missing} never pushed it; are all {table.world} workers stepping together?")
        log.warning("shard %d: %s", self.shard.index, text)
        h = Header(MsgType.SPARSE_PUSH, job_id=table.job_id, round=rnd, index=table.table_id, world=table.world,
                   offset=part.index)
        for rank in pending:
            peer = table.members.get(rank)
            if peer is not None:
                h.sender = rank
                self._answer(peer, h, MsgType.ERROR, wire.error_payload(ErrorCode.STALL, text))

    # -- rows ------------------------------------------------------------------------

    def _ps_slot(self, table: Table, h: Header) -> int:
        if table.mode != "ps":
            raise ControlError(ErrorCode.REFUSED, f"table {table.name!r} is an all-reduce table: it holds "
                                                         f"no rows to pull or load", "mode")
        if h.nsum > len(OPTIMIZERS[table.optimizer["name"]]):
            raise ControlError(ErrorCode.MALFORMED, f"table {table.name!r} has state slots 0.."
                                                           f"{len(OPTIMIZERS[table.optimizer['name']])}, not {h.nsum}", "slot")
        return h.nsum

    def _on_pull(self, peer, h: Header, payload) -> None:
        table, part = self._locate(peer, h)
        slot = self._ps_slot(table, h)
        idx, _ = self._rows_of(table, part, h, payload, None)
        self.counters["sparse_pulls"] += 1
        # the rows are gathered straight into the answer (indices checked:
        # "clip" then never clips, and spares take's buffered out)
        out, out_idx, out_rows = sparse_layout.row_payload(idx.size, table.width)
        out_idx[:] = idx
        np.take(part.slots[slot], idx - part.lo, axis=0, out=out_rows, mode="clip")
        self._answer(peer, h, MsgType.SPARSE_ROWS, out, idx.size)

    def _on_load(self, peer, h: Header, payload) -> None:
        table, part = self._locate(peer, h)
        slot = self._ps_slot(table, h)
        idx, rows = self._rows_of(table, part, h, payload, table.width)
        part.slots[slot][idx - part.lo] = rows
        part.step = h.round  # the checkpoint's optimizer step
        self.counters["sparse_loads"] += 1
        self._answer(peer, h, MsgType.SPARSE_ROWS)

    def describe(self, jobs: set | None = None) -> dict:
        return {"memory_used": self.used, "memory_bound": self.bound, "tables": {
            f"{t.job}/{t.name}": {"mode": t.mode, "rows": t.rows, "width": t.width, "partitions": sorted(t.parts),
                                  "optimizer": t.optimizer["name"], "bytes": t.nbytes, "pending_bytes": t.pending,
                                  "members": sorted(t.members),
                                  "open_rounds": sum(len(p.rounds) for p in t.parts.values())}
            for t in self.tables.values() if jobs is None or t.job in jobs}}


def _describe(t: Table) -> str:
    pushers = f", {t.pushers} pushing host(s)" if t.pushers != t.world else ""
    return (f"{t.rows} x {t.width} in {t.partitions} partition(s), {t.mode} mode, op {t.op}, optimizer "
            f"{t.optimizer}, init {t.init}{pushers}")
