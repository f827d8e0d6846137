"""The worker side of aggnet's sparse tables (the parameter server on the
aggregator hosts, :mod:`aggnet.hosts.sparse`).

A worker sends each table row once per step: repeated indices are summed
here first (Parallax's local aggregation), the rows split by partition and
each partition's rows go to the shard that owns it, over the service's own
transport. A step is a *round*: a worker pushes every partition of a table
every round (an empty push where it touched none), and a partition answers
once all workers pushed, so every worker sees the same round complete.

* ``mode="allreduce"``: :meth:`SparseTable.allreduce` returns the sum (or
  average) of every worker's rows at the union of their indices; the
  worker's own optimizer steps (the DDP hook's sparse buckets).
* ``mode="ps"``: the table and its optimizer state live on the shards;
  :meth:`SparseTable.push` sends gradients (the server steps once every
  worker's are in), :meth:`SparseTable.pull` reads the rows a step needs,
  :meth:`SparseTable.save`/:meth:`SparseTable.load` move a table and its
  optimizer state to and from files, a block at a time.

All socket work happens on one thread per client, so calls may come from
any thread (autograd's included); each returns a future, and each wait on
the wire ends after the client's ``timeout`` with an error naming what is
missing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from aggnet.protocol import keys, sparse_layout, wire
from aggnet.errors import AggregationError, AggregationTimeout, AggregatorUnreachable, ClientClosed
from aggnet.client import session
from aggnet.client.host_group import HostGroup, LocalChannel, channel_path
from aggnet.transport import TransportError, connect
from aggnet.protocol.wire import DType, Flag, Header, MsgType

log = logging.getLogger("aggnet.sparse")

#: state slots of each server-side optimizer, after the weights (slot 0);
#: the same list as the shard's (hosts/sparse.py), named for checkpoints
OPTIMIZER_SLOTS = {"sum": (), "sgd": (), "momentum": ("momentum",), "adagrad": ("sum",),
                   "adam": ("exp_avg", "exp_avg_sq")}
_HYPER = ("lr", "momentum", "lr_decay", "initial_accumulator_value", "beta1", "beta2", "eps")
CHECKPOINT_FORMAT = 1


class SparseClient:
    """One worker's connection to the sparse tables of a service."""

    def __init__(self, shards: list[str], *, job: str, rank: int, world_size: int, timeout: float = 60.0,
                 connect_timeout: float = 30.0, key: bytes | None = None, transport_options: dict | None = None,
                 host_group: HostGroup | str | None = "env"):
        if not shards:
            raise ValueError("a sparse client needs the service's shard addresses (its HELLO reply lists them)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.shards = list(shards)
        self.job, self.rank, self.world_size = job, rank, world_size
        from aggnet.protocol.wire import job_id_of

        self.job_id = job_id_of(job)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._key = key
        if host_group == "env":
            host_group = HostGroup.from_env(rank, world_size)
        if host_group is not None:
            if not isinstance(host_group, HostGroup):
                raise TypeError(f"host_group must be a HostGroup, None or 'env', got {host_group!r}")
            if host_group.rank() != rank or host_group.nodes * host_group.local_size != world_size:
                raise ValueError(f"{host_group} numbers rank {host_group.rank()} of "
                                 f"{host_group.nodes * host_group.local_size}, but this is rank {rank} of "
                                 f"{world_size}: ranks must go host by host (node * local_size + local_rank)")
            if host_group.local_size == 1:
                host_group = None
        #: the workers of this host that combine their rows (None: every
        #: worker pushes its own)
        self.host_group: HostGroup | None = host_group
        self._bytes_local_closed = 0  # handed within the host by tables since closed
        self._conn = connect(self.shards, **(transport_options or {}))
        self._exec = ThreadPoolExecutor(1, thread_name_prefix=f"aggnet-sparse-{job}-{rank}")
        self._closed = False
        self.tables: dict[str, SparseTable] = {}
        #: bytes of row payloads sent and received (what the PS path moves
        #: over the network), and handed between workers of this host
        self.bytes_sent = 0
        self.bytes_received = 0
        self.counters: dict[str, int] = {}

    @classmethod
    def of(cls, client, host_group: HostGroup | str | None = "env") -> "SparseClient":
        """The sparse client beside a connected :class:`aggnet.Client`: the
        same service (its embedded default too), job, rank and settings."""
        shards = getattr(client, "shards", None)
        if not isinstance(shards, list):
            raise ValueError(f"sparse tables live on aggregator services (zmq+tcp, zmq+ipc, shm, ucx, inproc), not "
                             f"on {client.address}: point the worker at an `aggnet serve` address for its sparse "
                             f"parameters, or keep them on torch.distributed")
        if client.members != client.world_size:
            raise ValueError(f"rank {client.rank} all-reduces through its rack's aggregator, which sees "
                             f"{client.members} of the job's {client.world_size} workers; sparse tables need one "
                             f"service that every worker reaches")
        return cls(shards, job=client.job, rank=client.rank, world_size=client.world_size,
                   timeout=client.config.timeout, connect_timeout=client.config.connect_timeout,
                   key=getattr(client, "_key", None), transport_options=getattr(client, "_transport_options", None),
                   host_group=host_group)

    def table(self, name: str, rows: int, width: int, *, mode: str = "ps", optimizer: str = "sgd",
              op: str = "sum", partitions: int | None = None, init: dict | None = None, **hyper) -> "SparseTable":
        """Create the table, or open it as the other workers did (every
        worker passes the same arguments). ``partitions`` defaults to the
        number of shards; ``init`` ({"kind": "normal"|"uniform"|"zeros",
        "scale": s, "seed": k}) fills a ``ps`` table on the server;
        ``hyper`` are the optimizer's (lr, momentum, lr_decay,
        initial_accumulator_value, beta1, beta2, eps, as torch names them)."""
        if mode not in ("ps", "allreduce"):
            raise ValueError(f"mode must be 'ps' or 'allreduce', got {mode!r}")
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        if optimizer not in OPTIMIZER_SLOTS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZER_SLOTS)}, got {optimizer!r}")
        unknown = set(hyper) - set(_HYPER)
        if unknown:
            raise ValueError(f"unknown optimizer setting(s) {sorted(unknown)}; known: {list(_HYPER)}")
        for what, value, hi in (("rows", rows, sparse_layout.MAX_ROWS), ("width", width, sparse_layout.MAX_WIDTH)):
            if not isinstance(value, (int, np.integer)) or not 1 <= value <= hi:
                raise ValueError(f"{what} must be an integer in [1, {hi}], got {value!r}")
        partitions = min(len(self.shards), rows) if partitions is None else partitions
        if not 1 <= partitions <= min(rows, sparse_layout.MAX_PARTITIONS):
            raise ValueError(f"partitions must be in [1, {min(rows, sparse_layout.MAX_PARTITIONS)}], got {partitions}")
        if name in self.tables:
            raise ValueError(f"table {name!r} is already open on this client")
        t = SparseTable(self, name, int(rows), int(width), mode=mode, optimizer=optimizer, op=op,
                        partitions=partitions, init=init, hyper={k: float(v) for k, v in hyper.items()})
        t._open()
        self.tables[name] = t
        return t

    def close(self) -> None:
        if self._closed:
            return
        for t in list(self.tables.values()):
            try:
                t.close()
            except Exception as exc:  # closing must go on to release the socket
                log.debug("closing sparse table %r: %s", t.name, exc)
        self._closed = True
        self._exec.shutdown(wait=True)
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the wire (runs on the client's one I/O thread) --------------------------------

    def _submit(self, fn, *args) -> Future:
        if self._closed:
            raise ClientClosed(f"the sparse client of job {self.job!r} rank {self.rank} is closed")
        return self._exec.submit(fn, *args)

    def _context(self) -> str:
        return f"job {self.job!r} rank {self.rank}"

    @property
    def bytes_local(self) -> int:
        """Row bytes handed between workers of this host (not the network)."""
        return self._bytes_local_closed + sum(t._channel.bytes_local for t in list(self.tables.values())
                                              if t._channel is not None)

    def _exchange(self, messages: list, timeout: float, what: str, expect: list = (), take=None) -> dict:
        """Send (shard, header, payload) messages and wait for each one's
        answer, and for the ``expect`` keys' (answers to pushes that this
        host's leader sent for this worker): {key: (header, payload bytes)}
        with key (shard, request type, table id, partition, round).
        ``take(key, header, payload)``, where given, reads each answer's
        payload while the transport still holds it, and its result stands
        in for the bytes: a pull's rows then go straight to their place
        instead of through a copy."""
        waiting = {k: None for k in expect}
        for shard, h, payload in messages:
            packed = h.pack() if payload is None else h.pack_for(payload)
            try:
                self._conn.send(shard, packed, payload or None)
            except TransportError as exc:
                raise AggregatorUnreachable(f"{self._context()}: cannot reach shard {self.shards[shard]}: {exc}") \
                    from None
            self.bytes_sent += len(payload or b"")
            waiting[(shard, int(h.msg_type), h.index, h.offset, h.round)] = h
        replies = {}
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                where = sorted({f"{self.shards[k[0]]} (partition {k[3]})" for k in waiting})
                raise AggregationTimeout(
                    f"{self._context()}: {what}: no answer within {timeout:g}s from {', '.join(where[:4])}"
                    f"{' ...' if len(where) > 4 else ''}; is the service running and are all {self.world_size} "
                    f"workers stepping the table together?")
            msg = self._conn.recv(min(left, 0.5))
            if msg is None:
                continue
            try:
                h = wire.unpack_header(msg.header)
                wire.check_payload(h, len(msg.payload))
            except wire.WireError:
                continue
            key = (msg.peer, h.exponent, h.index, h.offset, h.round)
            if h.job_id != self.job_id or key not in waiting:
                continue  # an answer to a request that already failed
            if h.msg_type == MsgType.ERROR:
                raise session.wire_error(msg.payload, f"{self._context()}: {what}: shard {self.shards[msg.peer]}")
            del waiting[key]
            self.bytes_received += len(msg.payload)
            replies[key] = (h, bytes(msg.payload) if take is None else take(key, h, msg.payload))
        return replies


class SparseTable:
    """One table as a worker sees it (made by :meth:`SparseClient.table`)."""

    def __init__(self, client: SparseClient, name: str, rows: int, width: int, *, mode: str, optimizer: str,
                 op: str, partitions: int, init: dict | None, hyper: dict):
        self.client = client
        self.name, self.rows, self.width = name, rows, width
        self.mode, self.optimizer, self.op = mode, optimizer, op
        self.partitions = partitions
        self.init = init
        self.hyper = hyper
        self.id = sparse_layout.table_id(name)
        self.edges = sparse_layout.bounds(rows, partitions)
        self.round = 0
        self._seq = 0
        self._holders = sorted({sparse_layout.shard_of(p, len(client.shards)) for p in range(partitions)})
        #: the path of this table's rows between the workers of a host
        self._channel: LocalChannel | None = None

    def _local(self) -> LocalChannel:
        """The table's own socket between the workers of this host (one per
        table: two clients of a worker, the DDP hook's and a module's, never
        share one). Used on the client's I/O thread only."""
        c = self.client
        if self._channel is None:
            self._channel = LocalChannel(c.host_group, channel_path(c.shards[0], c.job, self.name, c.host_group.node),
                                         (self.rows, self.width), self.id, c.counters)
        return self._channel

    def _close_channel(self) -> None:
        if self._channel is not None:
            self.client._bytes_local_closed += self._channel.bytes_local
            self._channel.close()
            self._channel = None

    def _shard(self, p: int) -> int:
        return sparse_layout.shard_of(p, len(self.client.shards))

    def _header(self, t: MsgType, p: int, rnd: int, n: int = 0, slot: int = 0) -> Header:
        c = self.client
        return Header(t, job_id=c.job_id, round=rnd & 0xFFFFFFFF, index=self.id, sender=c.rank, world=c.world_size,
                      flags=Flag.LITTLE_ENDIAN, dtype=DType.NONE, offset=p, ref=n, nsum=slot)

    # -- opening ---------------------------------------------------------------------

    def _table_request(self, close: bool = False) -> list:
        c = self.client
        fields = {"job": c.job, "table": self.name, "rows": self.rows, "width": self.width,
                  "partitions": self.partitions, "shards": len(c.shards), "mode": self.mode, "op": self.op,
                  "optimizer": {"name": self.optimizer, **self.hyper}}
        if self.init is not None:
            fields["init"] = self.init
        if c.host_group is not None:
            fields["pushers"] = c.host_group.nodes
            fields["pusher"] = int(c.host_group.leader)
        if close:
            fields["close"] = 1
        h = self._header(MsgType.TABLE, 0, 0)
        if c._key is not None:
            fields["auth"] = keys.sign(c._key, "TABLE", h.job_id, h.sender, h.world, fields)
        payload = wire.json_payload(fields)
        return [(s, h, payload) for s in self._holders]

    def _open(self) -> dict:
        c = self.client
        replies = c._submit(c._exchange, self._table_request(), c.connect_timeout,
                            f"opening table {self.name!r}").result(c.connect_timeout + 5)
        return {k[0]: wire.parse_json(p) for k, (h, p) in replies.items()}

    def steps(self) -> dict[int, int]:
        """Optimizer steps applied, per partition."""
        out = {}
        for info in self._open().values():
            out.update({int(p): s for p, s in info.get("steps", {}).items()})
        return out

    def close(self) -> None:
        """Leave the table; the last worker to leave frees it on the shards."""
        c = self.client
        c.tables.pop(self.name, None)
        try:
            c._submit(c._exchange, self._table_request(close=True), min(c.timeout, 5.0),
                      f"closing table {self.name!r}").result(min(c.timeout, 5.0) + 5)
        finally:
            if self._channel is not None and not c._closed:
                c._submit(self._close_channel).result(5)

    # -- checks ----------------------------------------------------------------------

    def _indices(self, indices) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"indices of table {self.name!r} must be integers, got {idx.dtype}")
        idx = idx.reshape(-1).astype(np.int64, copy=False)
        if idx.size and (idx.min() < 0 or idx.max() >= self.rows):
            bad = idx[(idx < 0) | (idx >= self.rows)]
            raise IndexError(f"table {self.name!r} has rows 0..{self.rows - 1}; {bad.size} index(es) are outside, "
                             f"e.g. {int(bad[0])}; nothing was sent")
        return idx

    def _rows(self, rows, n: int) -> np.ndarray:
        arr = np.asarray(rows)
        if arr.ndim != 2 or arr.shape[1] != self.width or arr.shape[0] != n:
            raise ValueError(f"table {self.name!r} takes rows of {self.width} floats, one per index ({n} x "
                             f"{self.width}); got shape {arr.shape}; nothing was sent")
        arr = np.ascontiguousarray(arr, np.float32)
        if not np.isfinite(arr).all():
            raise ValueError(f"rows for table {self.name!r} hold NaN/Inf; nothing was sent")
        return arr

    def _split(self, idx: np.ndarray) -> list[tuple[int, int]]:
        """Start and stop of each partition's part of sorted ``idx``."""
        cuts = np.searchsorted(idx, self.edges)
        return [(int(cuts[p]), int(cuts[p + 1])) for p in range(self.partitions)]

    # -- rounds ----------------------------------------------------------------------

    def _round(self, indices, rows, what: str):
        """The next round's number, and the function (for the client's I/O
        thread) that sends this worker's rows and returns the answers: the
        rows go to the shards, or to this host's leader, which sums its
        host's rows and pushes them once."""
        idx = self._indices(indices)
        vals = self._rows(rows, idx.size)
        c = self.client
        group = c.host_group
        # rows pushed from here are packed (copied) at once; a follower's
        # go to its leader zero-copy, so they must not be the caller's
        idx, vals = sparse_layout.combine(idx, vals, copy=group is not None) if idx.size else (idx, vals)
        self.round += 1
        rnd = self.round
        what = f"{what} round {rnd} of table {self.name!r}"
        if group is None:
            msgs = self._push_messages(idx, vals, rnd)
            return rnd, lambda: c._exchange(msgs, c.timeout, what)
        if not group.leader:
            def hand():
                self._local().hand(rnd, idx, vals, c.timeout)
                return c._exchange([], c.timeout, f"{what} (its rows went to rank {group.rank() - group.local_rank},"
                                                  f" the first worker of host {group.node}, which pushes the host's "
                                                  f"rows: is it running and stepping this table?)",
                                   expect=[self._key(MsgType.SPARSE_PUSH, p, rnd) for p in range(self.partitions)])
            return rnd, hand

        def lead():
            others = self._local().collect(rnd, c.timeout, what)
            # the leader's rows first, then local ranks 1.. in order: each
            # row is summed in local-rank order
            host_idx, host_vals, _ = sparse_layout.combine_parts([(idx, vals)] + others, self.width)
            return c._exchange(self._push_messages(host_idx, host_vals, rnd), c.timeout, what)
        return rnd, lead

    def _push_messages(self, idx: np.ndarray, vals: np.ndarray, rnd: int) -> list:
        return [(self._shard(p), self._header(MsgType.SPARSE_PUSH, p, rnd, b - a),
                 sparse_layout.pack_rows(idx[a:b], vals[a:b]))
                for p, (a, b) in enumerate(self._split(idx))]

    def push(self, indices, rows) -> Future:
        """Push this worker's gradient rows for the next round of a ``ps``
        table; resolves (to None) once every worker's are in and applied."""
        if self.mode != "ps":
            raise ValueError(f"table {self.name!r} is an all-reduce table: use allreduce()")
        rnd, send = self._round(indices, rows, "push")
        return self.client._submit(send)

    def allreduce(self, indices, rows) -> Future:
        """Sum (or average, ``op="avg"``) rows over every worker of an
        ``allreduce`` table; resolves to (sorted unique indices, rows)."""
        if self.mode != "allreduce":
            raise ValueError(f"table {self.name!r} is a parameter-server table: use push() and pull()")
        rnd, send = self._round(indices, rows, "all-reduce")
        c = self.client

        def run():
            replies = send()
            parts = [sparse_layout.unpack_rows(replies[self._key(MsgType.SPARSE_PUSH, p, rnd)][1],
                                               replies[self._key(MsgType.SPARSE_PUSH, p, rnd)][0].ref, self.width)
                     for p in range(self.partitions)]
            idx = np.concatenate([i for i, _ in parts]) if parts else np.empty(0, np.int64)
            vals = np.concatenate([v for _, v in parts]) if parts else np.empty((0, self.width), np.float32)
            return idx, vals

        return c._submit(run)

    def _key(self, t: MsgType, p: int, rnd: int) -> tuple:
        return (self._shard(p), int(t), self.id, p, rnd & 0xFFFFFFFF)

    # -- rows ------------------------------------------------------------------------

    def pull(self, indices, slot: int = 0) -> Future:
        """Rows at ``indices`` (any order, repeats allowed) of a ``ps``
        table; resolves to a (len(indices), width) float32 array. ``slot``
        > 0 reads the optimizer's state instead of the weights."""
        if self.mode != "ps":
            raise ValueError(f"table {self.name!r} is an all-reduce table: it holds no rows")
        idx = self._indices(indices)
        if idx.size < 2 or bool((idx[1:] > idx[:-1]).all()):
            uniq, inverse = idx, None  # sorted and unique already (ShardedEmbedding's)
        else:
            uniq, inverse = np.unique(idx, return_inverse=True)
        self._seq += 1
        seq = self._seq
        msgs = [(self._shard(p), self._header(MsgType.SPARSE_PULL, p, seq, b - a, slot),
                 sparse_layout.pack_rows(uniq[a:b], None))
                for p, (a, b) in enumerate(self._split(uniq)) if b > a]
        c = self.client

        spans = {self._key(MsgType.SPARSE_PULL, p, seq): (a, b) for p, (a, b) in enumerate(self._split(uniq))}

        def run():
            out = np.empty((uniq.size, self.width), np.float32)

            def take(key, h, payload):
                a, b = spans[key]
                out[a:b] = sparse_layout.unpack_rows(payload, b - a, self.width)[1]

            c._exchange(msgs, c.timeout, f"pull from table {self.name!r}", take=take)
            return out if inverse is None else out[inverse.reshape(-1)]

        return c._submit(run)

    def write(self, start: int, values, slot: int = 0, step: int = 0) -> None:
        """Set rows start.. of a ``ps`` table's ``slot`` (0: weights) and
        its optimizer step count: a restore, or initial weights. Call it on
        one worker while the others wait (a barrier)."""
        c = self.client
        values = self._rows(values, len(values))
        idx = self._indices(np.arange(start, start + len(values)))
        block = sparse_layout.block_rows(self.width)
        for a0 in range(0, idx.size, block):
            sub, rows = idx[a0:a0 + block], values[a0:a0 + block]
            msgs = [(self._shard(p), self._header(MsgType.SPARSE_LOAD, p, step, b - a, slot),
                     sparse_layout.pack_rows(sub[a:b], rows[a:b]))
                    for p, (a, b) in enumerate(self._split(sub)) if b > a]
            c._submit(c._exchange, msgs, c.timeout, f"load into table {self.name!r}").result(c.timeout + 5)

    # -- checkpoints -----------------------------------------------------------------

    def save(self, path: str) -> None:
        """Write the table and its optimizer state to directory ``path``
        (meta.json and one .npy per state slot), a block of rows at a time
        so that no worker ever holds the whole table. Call it on one worker
        between rounds (after its push completed, before its next one):
        no round can then complete while it reads."""
        if self.mode != "ps":
            raise ValueError(f"table {self.name!r} is an all-reduce table: it holds nothing to save")
        steps = set(self.steps().values())
        if len(steps) != 1:
            raise AggregationError(f"table {self.name!r}: partitions are at different optimizer steps {sorted(steps)}"
                                   f"; save between rounds, when no worker is pushing")
        os.makedirs(path, exist_ok=True)
        slots = ("weights",) + OPTIMIZER_SLOTS[self.optimizer]
        block = sparse_layout.block_rows(self.width)
        for k, slot in enumerate(slots):
            out = np.lib.format.open_memmap(os.path.join(path, f"{slot}.npy"), mode="w+", dtype=np.float32,
                                            shape=(self.rows, self.width))
            for a in range(0, self.rows, block):
                out[a:a + block] = self.pull(np.arange(a, min(self.rows, a + block)), slot=k).result(
                    self.client.timeout + 5)
            out.flush()
            del out
        meta = {"format": CHECKPOINT_FORMAT, "table": self.name, "rows": self.rows, "width": self.width,
                "optimizer": self.optimizer, "hyper": self.hyper, "op": self.op, "step": steps.pop(),
                "round": self.round, "slots": list(slots)}
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote (any partition count); call it on
        one worker while the others wait. The table must have the saved
        shape and optimizer."""
        if self.mode != "ps":
            raise ValueError(f"table {self.name!r} is an all-reduce table: it holds nothing to load")
        try:
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a sparse table checkpoint (meta.json: {exc})") from None
        saved = (meta.get("rows"), meta.get("width"), meta.get("optimizer"))
        if saved != (self.rows, self.width, self.optimizer):
            raise ValueError(f"checkpoint {path} holds a {saved[0]} x {saved[1]} table with optimizer {saved[2]!r}; "
                             f"table {self.name!r} is {self.rows} x {self.width} with {self.optimizer!r}")
        block = sparse_layout.block_rows(self.width)
        for k, slot in enumerate(meta["slots"]):
            data = np.load(os.path.join(path, f"{slot}.npy"), mmap_mode="r")
            for a in range(0, self.rows, block):
                self.write(a, np.asarray(data[a:a + block]), slot=k, step=int(meta["step"]))
            del data

    def saved_round(self, path: str) -> int:
        """The round counter at the time of a checkpoint (every worker sets
        its own from it when restoring: rounds then continue in step)."""
        with open(os.path.join(path, "meta.json")) as f:
            return int(json.load(f)["round"])
