"""PyTorch DDP communication hook: gradients aggregated through aggnet.

One line in a torchrun script::

    from aggnet.torch import AggnetState, allreduce_hook
    ddp_model.register_comm_hook(AggnetState(codec="int32"), allreduce_hook)

The hook streams each bucket's flat gradient buffer through an aggnet
:class:`~aggnet.Client` and completes DDP's future once the aggregated
bucket is back in place; it returns at once, so autograd keeps computing
the next buckets while this one is on the wire.

Sparse gradients (``nn.Embedding(sparse=True)``) get a bucket of their own
whose buffer is a sparse COO tensor. They never go down aggnet's dense path:
with ``sparse="aggnet"`` (the default) they go to the service's sparse
tables in all-reduce mode (:mod:`aggnet.torch.sparse`); with
``sparse="torch"``, or for buckets that are not float32 rows of one sparse
dimension, torch.distributed all-reduces them on the DDP process group.
Either way they are averaged or summed as ``sparse_op`` says.
"""

import atexit
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from aggnet import kernels
from aggnet.client.arrays import tensor_view
from aggnet.client.base import Client
from aggnet.client.config import ClientConfig
from aggnet.errors import AggnetError, AggregatorUnreachable, NonFiniteError
from aggnet.torch.futures import torch_future
from aggnet.torch.staging import ClientQueue, Stager, quantize_block, result_nonfinite

__all__ = ["AggnetState", "allreduce_hook"]

_CODECS = {None: None, "float32": None, "int32": "int32", "fp16": "fp16", "bf16": "bf16"}
_OPS = ("avg", "sum")
_ON_NONFINITE = ("raise", "propagate")
_state_counter = itertools.count()
log = logging.getLogger("aggnet.torch")
_CPU_KERNELS = kernels.load("cpu")


@dataclass
class BucketStats:
    calls: int = 0
    elements: int = 0
    wire_bytes: int = 0
    chunks: int = 0  #: chunks (or switch packets) the bucket travelled in
    seconds: float = 0.0  #: hook call to aggregated bucket, summed
    last_seconds: float = 0.0  #: the same, of the latest call
    #: calls all-reduced by the DDP group instead (a type aggnet does not carry)
    delegated: int = 0



def _check_options(*, codec, op, sparse_op, sparse, alpha_threshold, alpha_steps, on_nonfinite, job, staleness,
                   predict, staging) -> None:
    """One line naming the AggnetState argument that is out of range."""
    if codec not in _CODECS:
        raise ValueError(f"codec must be one of {list(_CODECS)}, got {codec!r}")
    for name, value in (("op", op), ("sparse_op", sparse_op)):
        if value not in _OPS:
            raise ValueError(f"{name} must be one of {_OPS}, got {value!r}")
    if sparse not in ("aggnet", "torch"):
        raise ValueError(f"sparse must be 'aggnet' or 'torch', got {sparse!r}")
    if alpha_threshold is not None and not 0 < alpha_threshold <= 1:
        raise ValueError(f"alpha_threshold must be in (0, 1] (or None: no routing by α), got {alpha_threshold!r}")
    if not isinstance(alpha_steps, int) or alpha_steps < 1:
        raise ValueError(f"alpha_steps must be an integer >= 1, got {alpha_steps!r}")
    if on_nonfinite not in _ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}")
    if job is not None and (not isinstance(job, str) or not job):
        raise ValueError(f"job must be a non-empty name, got {job!r}")
    if not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0 (steps a gradient is applied late), got {staleness!r}")
    if predict and not staleness:
        raise ValueError("predict=True needs staleness >= 1: with no delay there is nothing to predict")
    if staging not in (True, False, "always"):
        raise ValueError(f"staging must be True, False or 'always', got {staging!r}")

class AggnetState:
    """Settings and connection of the aggnet DDP hook.

    * ``address``: aggregator service (None: ``AGGNET_ADDRESS``, else an
      embedded aggregator on rank 0's machine);
    * ``codec``: ``"float32"`` (or None), ``"int32"`` (quantized with a
      scale agreed per chunk), ``"fp16"`` or ``"bf16"``;
    * ``op`` / ``sparse_op``: ``"avg"`` (DDP's own semantics) or ``"sum"``,
      for dense and sparse buckets separately (Parallax lets users choose);
    * ``sparse``: ``"aggnet"`` (sparse buckets through the service's sparse
      tables) or ``"torch"`` (torch.distributed's sparse all-reduce);
    * ``check_finite``: look for NaN/Inf in every bucket and, with
      ``on_nonfinite="raise"``, fail the step naming the bucket and the rank;
      ``"propagate"`` passes them on (AMP's GradScaler then skips the step);
    * ``job``: the aggregator job name; by default one is agreed over the
      process group, distinct for every DDP model of the run;

    The state may be built before ``init_process_group`` (Lightning builds
    its strategy, and the state with it, before the processes exist): rank,
    world size and job are then resolved on the first bucket.
    * ``topology``: a topology file of racks (:mod:`aggnet.protocol.topology`; None:
      ``AGGNET_TOPOLOGY`` when no address is set): each rank all-reduces
      through its rack's aggregator, and the racks through the root.
    * ``alpha_threshold`` / ``alpha_steps``: routing by α
      (:mod:`aggnet.torch.routing`): a dense bucket's 2-D parameter whose
      fraction of non-zero gradient rows, measured over the first
      ``alpha_steps`` steps, is below ``alpha_threshold`` travels as rows
      through a sparse table (an ``nn.Embedding`` without ``sparse=True``);
      None: every dense bucket all-reduced whole. ``stats()["routes"]``
      says what each bucket does.
    * ``member``: (this rank's place among the job's workers at its
      aggregator, how many join there) for a process group spread over
      racks that each join their own rack's ``address`` (a pipeline
      stage's data-parallel group, :mod:`aggnet.parallel`); None: every
      rank of the group joins the one aggregator.
    * ``staleness`` / ``predict``: stale-gradient data parallelism
      (:mod:`aggnet.torch.stale`): each step's all-reduce runs during the
      next ``staleness`` steps and is applied then, so the network hides
      behind compute; with ``predict`` the step computes at the weights
      predicted for when its gradient lands (drive the steps with
      :class:`aggnet.torch.StaleStep`). 0: synchronous, DDP's own semantics.
    * ``staging``: buckets on a GPU are encoded on the device and staged
      through pinned host memory on a side stream
      (:mod:`aggnet.torch.staging`), so the backward pass never waits for
      them; False copies each to the CPU and back on the training stream
      (slower: kept to compare with); ``"always"`` stages CPU buckets the
      same way too, through every function a GPU bucket goes through
      (slower than sending them from where they are: for tests).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        process_group=None,
        job: str | None = None,
        codec: str | None = None,
        op: str = "avg",
        sparse_op: str = "avg",
        sparse: str = "aggnet",
        check_finite: bool = True,
        on_nonfinite: str = "raise",
        config: ClientConfig | None = None,
        topology=None,
        alpha_threshold: float | None = 0.1,
        alpha_steps: int = 3,
        member: tuple[int, int] | None = None,
        staleness: int = 0,
        predict: bool = False,
        staging: bool | str = True,
    ):
        _check_options(codec=codec, op=op, sparse_op=sparse_op, sparse=sparse, alpha_threshold=alpha_threshold,
                       alpha_steps=alpha_steps, on_nonfinite=on_nonfinite, job=job, staleness=staleness,
                       predict=predict, staging=staging)
        self.sparse = sparse
        self.alpha_threshold, self.alpha_steps = alpha_threshold, alpha_steps
        self.routes: dict = {}  #: bucket index -> routing.RouteStats
        self._route_buckets: dict = {}
        self.process_group = process_group
        self._job_arg = job
        self._member_arg = member
        #: this state's place among the states a process builds (every rank
        #: builds its DDP models in the same order): part of the agreed job name
        self._serial = next(_state_counter)
        self._resolved = False
        self.rank = self.world_size = self.job = None  # resolved from torch.distributed (_resolve)
        self.member = member
        self.codec = _CODECS[codec]
        self.op = op
        self.sparse_op = sparse_op
        self.check_finite = check_finite
        self.on_nonfinite = on_nonfinite
        self.config = config or ClientConfig.from_env()
        if codec is None:  # AGGNET_CODEC, shared with the process-group backend
            self.codec = _CODECS[self.config.codec]
        self.address = address if address is not None else self.config.address
        if address is not None and topology is not None:
            raise ValueError("give address or topology, not both: the topology names each rack's aggregator")
        self.topology = topology if topology is not None else (
            self.config.topology if self.address is None else None)
        if member is not None and address is None:
            raise ValueError("member goes with an address: the aggregator this rank's part of the group joins")
        self.staleness, self.predict = staleness, predict
        self.stale_queue = None
        if staleness:
            from aggnet.torch.stale import StaleQueue

            self.stale_queue = StaleQueue(staleness)
        self.buckets: dict[int, BucketStats] = {}
        #: gradient types met that the DDP group all-reduces (told once each)
        self.delegated_dtypes: set[torch.dtype] = set()
        self.staging = staging
        self._stagers: dict[torch.device, Stager] = {}
        #: the order collectives reach the client in: staged buckets wait on
        #: a thread for their copies, and what is called straight on the
        #: client (the α agreements, a bucket's rest) queues behind them
        self._order = ClientQueue()
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        atexit.register(self.close)
        if dist.is_available() and dist.is_initialized():
            self._resolve(eager=True)
        # else (a framework that builds the strategy before the processes
        # exist, as Lightning does): rank, world and job on the first bucket

    def _resolve(self, eager: bool = False) -> None:
        """Rank, world size and job name from torch.distributed."""
        with self._resolve_lock:
            if self._resolved:
                return
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "aggnet DDP hook: torch.distributed is not initialized; torchrun sets up env:// rendezvous, "
                    "then call dist.init_process_group('gloo') before training")
            self.rank = dist.get_rank(self.process_group)
            self.world_size = dist.get_world_size(self.process_group)
            member = self._member_arg
            if member is not None and (len(member) != 2 or not all(isinstance(v, int) for v in member)
                                       or not 0 <= member[0] < member[1] <= self.world_size):
                raise ValueError(f"member must be (member_rank, members) with 0 <= member_rank < members <= "
                                 f"{self.world_size}, got {member!r}")
            self.member = member
            self.job = self._job_arg or (self._agree_job_name() if eager else self._agree_job_name_by_store())
            self._resolved = True

    def _agree_job_name(self) -> str:
        """A name every rank agrees on: rank 0's random tag, broadcast over
        the process group, plus a per-process counter of DDP models (ranks
        build their models in the same order)."""
        tag = [uuid.uuid4().hex[:10] if self.rank == 0 else None]
        dist.broadcast_object_list(tag, src=dist.get_global_rank(self.process_group, 0) if self.process_group else 0,
                                   group=self.process_group)
        return f"ddp-{tag[0]}-{self._serial}"

    def _agree_job_name_by_store(self) -> str:
        """The same agreement through the rendezvous store: resolved on the
        first bucket, inside DDP's backward, where no collective may run."""
        import datetime

        store = dist.distributed_c10d._get_default_store()
        group = "default" if self.process_group is None else dist.distributed_c10d._get_process_group_name(
            self.process_group)
        key = f"aggnet/ddp-job/{group}/{self._serial}"
        if self.rank == 0:
            store.set(key, uuid.uuid4().hex[:10])
        store.wait([key], datetime.timedelta(seconds=self.config.connect_timeout))
        return f"ddp-{store.get(key).decode()}-{self._serial}"

    def stager(self, device: torch.device) -> Stager:
        """The stager of ``device``'s buckets (one side stream and buffer
        pools per device, made on its first bucket). Its pinned buffers lie
        in shared memory where the client's aggregator reads them in place."""
        shared = getattr(self.client, "takes_shared", False)
        with self._lock:
            stager = self._stagers.get(device)
            if stager is None:
                stager = self._stagers[device] = Stager(device, through_host=True if self.staging == "always" else None,
                                                        shared=shared, order=self._order)
            return stager

    def staging_stats(self) -> dict:
        """Per device, the stager's buffer allocations (constant after the
        first step: the buckets reuse their pinned and device buffers)."""
        return {str(d): s.stats() for d, s in self._stagers.items()}

    @property
    def resolved(self) -> bool:
        """Whether rank, world size and job are known (torch.distributed was
        initialized when the state was built, or a bucket has gone through)."""
        return self._resolved

    @property
    def client(self) -> Client:
        """The aggnet client, connected on first use (the first bucket)."""
        if not self._resolved:
            self._resolve()
        with self._lock:
            if self._client is None:
                try:
                    if self.topology is not None:
                        self._client = Client(topology=self.topology, job=self.job, rank=self.rank,
                                              world_size=self.world_size, config=self.config.for_torch())
                    else:
                        placed = ({} if self.member is None else
                                  {"member_rank": self.member[0], "members": self.member[1]})
                        self._client = Client(self.address, job=self.job, rank=self.rank,
                                              world_size=self.world_size, config=self.config.for_torch(), **placed)
                except AggregatorUnreachable as exc:
                    hint = ("" if self.address or self.topology is not None else
                            " (no AGGNET_ADDRESS is set: the embedded aggregator serves only the workers on "
                            "rank 0's machine; for several machines start `aggnet serve` and set AGGNET_ADDRESS)")
                    raise AggregatorUnreachable(f"aggnet DDP hook, rank {self.rank}: {exc}{hint}") from None
            return self._client

    def stats(self) -> dict:
        """Totals over every bucket: calls, elements, wire bytes, seconds;
        per bucket, and under ``routes`` how each dense bucket travels
        (rows or dense, with its measured α)."""
        total = BucketStats()
        for b in self.buckets.values():
            total.calls += b.calls
            total.elements += b.elements
            total.wire_bytes += b.wire_bytes
            total.chunks += b.chunks
            total.seconds += b.seconds
            total.delegated += b.delegated
        return {"total": total, "buckets": dict(self.buckets), "routes": dict(self.routes)}

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            sparse, self._sparse_client = getattr(self, "_sparse_client", None), None
        if sparse is not None:
            sparse.close()
        if client is not None:
            client.close()
        atexit.unregister(self.close)


def _count_nonfinite(t: torch.Tensor, arr) -> int:
    """NaN/Inf count: one vectorized pass without temporaries for float32
    (the common case), torch's own ops for 16-bit buffers."""
    if t.dtype == torch.float32:
        return _CPU_KERNELS.block_stats(arr)[1]
    finite = torch.isfinite(t)
    return 0 if bool(finite.all()) else int((~finite).sum())


def _wire_itemsize(t: torch.Tensor, codec: str | None) -> int:
    if codec in ("fp16", "bf16"):
        return 2
    return t.element_size() if codec is None else 4


def allreduce_hook(state: AggnetState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce ``bucket`` through aggnet."""
    if not state._resolved:
        state._resolve()
    if state.staleness:
        from aggnet.torch.stale import allreduce_stale

        return allreduce_stale(state, bucket)
    buf = bucket.buffer()
    if buf.is_sparse:
        if state.alpha_threshold is not None:
            from aggnet.torch import routing

            routing.mark_sparse(state, bucket.index())
        return _sparse_allreduce(state, buf)
    if buf.dtype not in _CARRIED:
        return _delegated_allreduce(state, bucket.index(), buf)
    if state.alpha_threshold is not None:
        from aggnet.torch import routing

        fut = routing.route(state, bucket.index(), buf, bucket)
        if fut is not None:
            return fut
    return _dense_allreduce(state, bucket.index(), buf, bucket)


#: the gradient types aggnet's wire carries; a model of another (float64)
#: has its buckets all-reduced by torch.distributed on the DDP group
_CARRIED = (torch.float32, torch.float16, torch.bfloat16)


def _delegated_allreduce(state: "AggnetState", index: int, buf: torch.Tensor) -> torch.futures.Future:
    """A bucket of a type aggnet does not carry, summed (or averaged) by
    the DDP group's own all-reduce, as DDP's default hook would: training
    goes on, at that group's speed, and the user is told once."""
    if buf.dtype not in state.delegated_dtypes:
        state.delegated_dtypes.add(buf.dtype)
        log.warning("aggnet DDP hook: bucket %d holds %s gradients, which aggnet does not carry (it carries "
                    "float32, float16 and bfloat16): buckets of that type go through torch.distributed's "
                    "all_reduce on the DDP group instead; train in float32 to aggregate them with aggnet",
                    index, str(buf.dtype).replace("torch.", ""))
    stats = state.buckets.setdefault(index, BucketStats())
    world = state.world_size
    t0 = time.perf_counter()

    def finish(f) -> torch.Tensor:
        result = f.value()[0]
        if state.op == "avg":
            result.div_(world)
        stats.calls += 1
        stats.delegated += 1
        stats.elements += result.numel()
        stats.last_seconds = time.perf_counter() - t0
        stats.seconds += stats.last_seconds
        return result

    work = dist.all_reduce(buf, group=state.process_group, async_op=True)
    return work.get_future().then(finish)


def _dense_allreduce(state: "AggnetState", index: int, buf: torch.Tensor, bucket) -> torch.futures.Future:
    """One dense bucket through the state's :class:`~aggnet.torch.staging.Stager`
    for its device: on the CPU sent from where it is, on a GPU encoded on
    the device and staged through pinned memory off the training stream."""
    if buf.device.type != "cpu" and not state.staging:
        return _synchronous_allreduce(state, index, buf, bucket)
    t0 = time.perf_counter()
    stager = state.stager(buf.device)
    codec = state.codec if buf.dtype == torch.float32 else None
    client = state.client
    staged = stager.stage(buf.detach(), codec=codec, op=state.op, world=state.world_size,
                          check_finite=state.check_finite, block=quantize_block(client, codec, buf.dtype), key=index)
    fut = stager.submit(staged, lambda arr, **options: client.allreduce(
        arr, op=staged.op, codec=staged.codec, key=index, **options))
    stats = state.buckets.setdefault(index, BucketStats())
    wire_bytes = buf.numel() * _wire_itemsize(buf, codec)
    # a chunk client's chunks, or a switch client's packets of K values
    per_chunk = getattr(client, "chunk_bytes", None) or 4 * getattr(client, "elements", 1)
    chunks = -(-wire_bytes // per_chunk)

    def value(f) -> torch.Tensor:
        try:
            try:
                try:
                    f.result()
                except AggnetError as exc:
                    # say which bucket of which rank the client's error is about
                    raise type(exc)(f"aggnet DDP hook, bucket {index} on rank {state.rank}: {exc}") from None
                if state.check_finite and state.on_nonfinite == "raise":
                    _raise_nonfinite(state, index, bucket, staged.local_nonfinite(), result_nonfinite(staged))
            except NonFiniteError:
                if state.on_nonfinite != "propagate":
                    raise
                # the int32 codec cannot carry NaN: mark the whole bucket so
                # the optimizer (or GradScaler) sees it was not finite
                stager.release(staged)
                stager.after_result(lambda: buf.fill_(float("nan")))  # waited for, as a result would be
                return buf
            stager.unstage(staged)
        except BaseException:
            stager.release(staged)
            raise
        stats.calls += 1
        stats.elements += buf.numel()
        stats.wire_bytes += wire_bytes
        stats.chunks += chunks
        stats.last_seconds = time.perf_counter() - t0
        stats.seconds += stats.last_seconds
        return buf

    return torch_future(fut, value)


def _raise_nonfinite(state: "AggnetState", index: int, bucket, local_bad: int, result_bad: int) -> None:
    if local_bad:
        shapes = [tuple(p.shape) for p in bucket.parameters()]
        raise NonFiniteError(
            f"aggnet DDP hook: rank {state.rank}'s gradients in bucket {index} hold {local_bad} "
            f"NaN/Inf value(s) (parameters of shapes {shapes}); check the loss and inputs, or "
            f"use AggnetState(on_nonfinite='propagate') with AMP's GradScaler"
        )
    if result_bad:
        raise NonFiniteError(
            f"aggnet DDP hook: bucket {index} aggregated to NaN/Inf on rank {state.rank}: another "
            f"rank's gradients were not finite (that rank's error names it)"
        )


def _synchronous_allreduce(state: "AggnetState", index: int, buf: torch.Tensor, bucket) -> torch.futures.Future:
    """``AggnetState(staging=False)``: a device bucket copied to the CPU and
    back on the training stream, which waits for it; kept to compare with."""
    host = buf.detach().to("cpu")
    arr, hint = tensor_view(host)
    local_bad = _count_nonfinite(host, arr) if state.check_finite else 0
    codec = state.codec if host.dtype == torch.float32 else None
    client = state.client
    fut = state._order.call(lambda: client.allreduce(arr, op=state.op, codec=codec, key=index, _wire_hint=hint))

    def value(f) -> torch.Tensor:
        try:
            f.result()
        except AggnetError as exc:
            raise type(exc)(f"aggnet DDP hook, bucket {index} on rank {state.rank}: {exc}") from None
        if state.check_finite and state.on_nonfinite == "raise":
            _raise_nonfinite(state, index, bucket, local_bad, _count_nonfinite(host, arr))
        buf.copy_(host)
        return buf

    return torch_future(fut, value)


def _sparse_allreduce(state: AggnetState, buf: torch.Tensor) -> torch.futures.Future:
    """Sparse COO buckets: aggnet's sparse tables, or torch.distributed on
    the DDP process group."""
    from aggnet.torch import sparse

    if state.sparse == "aggnet" and sparse.supports(buf) and sparse.tables_reachable(state):
        return sparse.sparse_allreduce(state, buf)
    world = state.world_size

    def finish(f):
        result = f.value()[0]
        if state.sparse_op == "avg":
            result = result / world
        return result

    work = dist.all_reduce(buf.coalesce(), group=state.process_group, async_op=True)
    return work.get_future().then(finish)
