"""aggnet as a ``torch.distributed`` backend: ``init_process_group("aggnet")``.

::

    import aggnet.torch                      # registers the "aggnet" backend
    dist.init_process_group("aggnet")        # or "cpu:aggnet"; torchrun's env:// works

Then DDP (no comm hook needed), FSDP2 (``fully_shard``) and plain
``dist.all_reduce`` reach aggnet's aggregators without any other change.

What aggnet carries, and what it leaves to gloo
-----------------------------------------------

* ``all_reduce`` (``allreduce``, ``allreduce_coalesced``) with ``SUM`` or
  ``AVG`` on float32, float16, bfloat16 tensors, and ``SUM`` on int32;
  ``AVG`` of integer tensors is NCCL's: the sum (through aggnet for int32,
  gloo for the others), then division truncated toward zero (frameworks
  written for NCCL send it: Lightning's ``self.log(..., sync_dist=True)``
  averages its int64 batch-size counter);
* ``reduce_scatter_tensor`` / ``reduce_scatter_single``
  (``_reduce_scatter_base``), the list form ``reduce_scatter``, and their
  coalesced forms, with the same ops and dtypes: the aggregator returns each
  chunk of the sum only to the rank whose share it is, so a worker sends S
  and receives S/N (:meth:`aggnet.Client.reduce_scatter`).

Everything else runs on a gloo group the backend builds on the same store:
other ops (``MIN``, ``MAX``, ``PRODUCT``, bitwise) and dtypes (float64,
int64, uint8, bool, sparse tensors; a reduce-scatter of those is gloo's
all-reduce of a copy of which the rank keeps its share, since gloo's own
reduce-scatter gives no future to chain on), ``all_gather_into_tensor`` /
``all_gather_single`` and ``all_gather`` (aggnet has no gather path: an
aggregator sums, and a gather through it would move S each way, more than
gloo's ring), ``broadcast``, ``barrier``, ``send``/``recv``, ``gather``,
``scatter``, ``reduce``, ``all_to_all``. What neither can do fails at
once with :class:`UnsupportedCollective`, naming the collective and what
to use instead: ``AVG`` of bool or sparse tensors, or of integers mixed
with floats in one call, ``PREMUL_SUM``, tensors on other devices than
the CPU and CUDA GPUs. A CUDA tensor's all-reduce goes through the DDP
hook's staging (:mod:`aggnet.torch.staging`: encoded on the device, sent
from pinned memory, off the caller's stream), and so does its
reduce-scatter, of which only the rank's share comes back to the device;
gloo takes CUDA tensors for what it carries, through host memory; with
``cuda_delegate="nccl"`` (``AGGNET_CUDA_DELEGATE=nccl``) a group hands
the dense CUDA collectives it leaves to NCCL instead (FSDP2's all-gathers
of parameters over NVLink or RDMA; one GPU per rank, as NCCL needs).
Over a switch, or for a rank in a rack of a
hierarchy, where an aggregator cannot send one rank its share alone, a
reduce-scatter is an all-reduce of which each rank keeps its share.

How it plugs into torch (2.13), and why this way
------------------------------------------------

``dist.Backend.register_backend("aggnet", create, extended_api=True,
devices=["cpu", "cuda"])`` names the backend and its devices. ``create`` returns a
Python subclass of ``dist.ProcessGroup``; torch then uses that object as
the group itself (it registers no per-device backend on it). A group with
no backend for the CPU breaks every C++ path that asks for one: the group
name that ``DeviceMesh`` (and so FSDP2) reads ("ProcessGroup name not
set"), and the collectives that a Python subclass cannot override
(``all_gather_single``, ``gather``, ``scatter``, ...: "No backend type
associated with device type cpu"). So the group registers its internal
gloo backend for the CPU, and for CUDA where torch has it
(``ProcessGroup._register_backend(cpu, GLOO, gloo)``): the collectives aggnet carries are Python overrides (reached
through torch's ``PyProcessGroup`` trampoline by DDP's C++ reducer too),
and everything else falls through to gloo, as the list above says.

Overrides that hand an op to gloo call a second, plain ``ProcessGroup``
around the same gloo backend (the base class's method called on this
object would come back to the override). Every collective that the
trampoline lets a subclass override is overridden, even those gloo does:
for one that is not, the trampoline runs the base class's version while
holding the GIL, and gloo's worker thread, which may need the GIL to free
a finished collective's tensors while it holds gloo's queue, deadlocks
with it (seen with FSDP2's ``full_tensor()``). The plain group's binding
lets the GIL go first.

Every collective returns a :class:`AggnetWork` at once; its
``get_future()`` completes when the result is in place (DDP's reducer and
FSDP2 chain on it), and ``wait()`` gives up after the group's timeout
(``init_process_group(timeout=...)``), while the aggnet client itself
fails an operation that makes no progress for ``AGGNET_TIMEOUT`` seconds.

The aggregator is chosen as the DDP hook chooses it: ``AGGNET_ADDRESS``,
else ``AGGNET_TOPOLOGY``, else an embedded aggregator that rank 0 starts on
its machine; ``AGGNET_CODEC`` says how float32 tensors travel. A
:class:`aggnet.ClientConfig` passed as ``pg_options`` replaces the
environment. Each process group is its own aggnet job (named by rank 0
through the group's store), connected on its first aggnet collective.
"""

from __future__ import annotations

import atexit
import datetime
import sys
import threading
import uuid

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from aggnet.client.arrays import tensor_view
from aggnet.client.base import Client
from aggnet.client.config import ClientConfig
from aggnet.errors import AggnetError, AggregatorUnreachable
from aggnet.torch.futures import torch_future, when_all
from aggnet.torch.hook import _CODECS
from aggnet.torch.scale_keys import ScaleKeys
from aggnet.torch.staging import ClientQueue, Stager, quantize_block

__all__ = ["BACKEND_NAME", "AggnetProcessGroup", "AggnetWork", "UnsupportedCollective", "monitored_barrier",
           "register"]

BACKEND_NAME = "aggnet"

#: ReduceOp name -> aggnet op; the dtypes aggnet sums (int32 is never averaged)
_OPS = {"SUM": "sum", "AVG": "avg"}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: store key under which rank 0 leaves the group's aggnet job name
_JOB_KEY = "aggnet/job"


class UnsupportedCollective(NotImplementedError):
    """A collective that neither aggnet nor the delegated gloo group can do."""


class AggnetWork(dist._Work):
    """A collective in flight: ``get_future()`` for chaining, ``wait()``
    bounded by the group's timeout."""

    def __init__(self, future: torch.futures.Future, what: str, timeout: float, failure: list | None = None):
        super().__init__()
        self._future = future
        #: the error the collective ended with, raised as it is by wait()
        #: (the future carries it wrapped in torch's RuntimeError)
        self._failure = failure if failure is not None else []
        self._what = what
        self._timeout = timeout
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        limit = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0
        limit = limit if limit > 0 else self._timeout
        if not self._done.wait(limit):
            raise TimeoutError(f"aggnet backend: {self._what} did not finish within {limit:g}s; is every rank "
                               f"calling the same collectives in the same order? (init_process_group(timeout=...) "
                               f"sets this limit)")
        if self._failure:
            raise self._failure[0]
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.wait()
        except Exception:
            return False
        return True

    def exception(self):
        try:
            self._future.wait()
        except Exception as exc:
            return exc
        return None

    def result(self):
        return self._future.wait()


#: the integers NCCL averages (and gloo sums)
_INTEGERS = (torch.int8, torch.uint8, torch.int32, torch.int64)


def _integer_avg(tensors, op) -> bool:
    """An ``AVG`` whose tensors are all dense integers NCCL averages."""
    name = op.op.name if hasattr(op, "op") else str(op)
    return name == "AVG" and bool(tensors) and all(
        not t.is_sparse and t.dtype in _INTEGERS for t in tensors)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


class AggnetProcessGroup(dist.ProcessGroup):
    """One torch process group whose reductions go through aggnet."""

    #: True: CPU tensors too go through what a CUDA tensor goes through
    #: (:mod:`aggnet.torch.staging`: pools, narrowing, int32 quantized where
    #: the tensor is), as the DDP hook's ``AggnetState(staging="always")``;
    #: how the tests run the device path without a GPU. Set it on the group
    #: (``dist.group.WORLD``) before its first collective.
    stage_cpu_tensors = False

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta, *,
                 group_name: str = "", config: ClientConfig | None = None, global_ranks=None):
        super().__init__(rank, world_size)
        self._rank = rank
        self._world = world_size
        self._timeout = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        self.config = config if config is not None else ClientConfig.from_env()
        self.codec = _CODECS[self.config.codec]
        cpu, cuda = torch.device("cpu"), torch.device("cuda")
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout)
        GLOO, NCCL = dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroup.BackendType.NCCL
        nccl = None
        if self.config.cuda_delegate == "nccl":
            nccl = _nccl_backend(store, rank, world_size, timeout, group_name, global_ranks)
        # the CPU (and CUDA) backend of this group: what it does not
        # override runs there (gloo takes CUDA tensors for its collectives)
        devices = [cpu] + ([cuda] if torch.cuda.is_available() else [])
        for device in devices:
            if device == cuda and nccl is not None:
                self._register_backend(device, NCCL, nccl)
            else:
                self._register_backend(device, GLOO, gloo)
        # the same gloo backend behind a plain group, for the overrides
        # that hand an op on (this object's own methods would recurse)
        self._gloo = dist.ProcessGroup(store, rank, world_size)
        for device in devices:
            self._gloo._register_backend(device, GLOO, gloo)
        #: where the overrides hand a collective aggnet does not carry:
        #: the gloo group, or one whose CUDA tensors go to NCCL
        self._delegate = self._gloo
        self._nccl = nccl
        if nccl is not None:
            self._delegate = dist.ProcessGroup(store, rank, world_size)
            self._delegate._register_backend(cpu, GLOO, gloo)
            self._delegate._register_backend(cuda, NCCL, nccl)
            self._delegate._set_default_backend(GLOO)
        self._stagers: dict = {}
        #: the keys of int32 all-reduces and reduce-scatters (the order and
        #: sizes of the calls, alike on every rank), so that they carry
        #: their exponents
        self._scale_keys = ScaleKeys()
        #: the order collectives reach the client in: a device tensor's
        #: waits on a thread for its copy to the host, and a CPU tensor's,
        #: sent from where it is, queues behind it instead of overtaking it
        self._order = ClientQueue()
        self._gloo._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.job = self._agree_job(store, group_name)
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self._close_client)

    def _agree_job(self, store, group_name: str) -> str:
        """Rank 0 names the group's aggnet job; the others read it (the
        store is this group's own, so names never meet across groups)."""
        if self._rank == 0:
            store.set(_JOB_KEY, f"torch-{uuid.uuid4().hex[:10]}-{group_name or 'group'}")
        wait = self.config.connect_timeout
        try:
            store.wait([_JOB_KEY], datetime.timedelta(seconds=wait))
        except Exception as exc:
            raise AggregatorUnreachable(
                f"aggnet backend, rank {self._rank}: rank 0 did not name the group's aggnet job within {wait:g}s "
                f"({exc}); is rank 0 creating the same process group?") from None
        return store.get(_JOB_KEY).decode()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"AggnetProcessGroup(rank={self._rank}, world_size={self._world}, job={self.job!r})"

    # -- the aggnet client --------------------------------------------------------

    @property
    def client(self) -> Client:
        """Connected on the first aggnet collective: a group used only for
        gloo's collectives never starts or reaches an aggregator."""
        with self._lock:
            if self._client is None:
                if self._closed:
                    raise AggnetError(f"aggnet backend, rank {self._rank}: the process group was shut down")
                try:
                    self._client = Client(job=self.job, rank=self._rank, world_size=self._world,
                                          config=self.config.for_torch())
                except AggregatorUnreachable as exc:
                    hint = ("" if self.config.address or self.config.topology else
                            " (no AGGNET_ADDRESS is set: the embedded aggregator serves only the ranks on rank 0's "
                            "machine; for several machines start `aggnet serve` and set AGGNET_ADDRESS)")
                    raise AggregatorUnreachable(f"aggnet backend, rank {self._rank}: {exc}{hint}") from None
            return self._client

    def _close_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            self._closed = True
        if client is not None:
            client.close()
        atexit.unregister(self._close_client)

    def shutdown(self) -> None:
        """``destroy_process_group``: leave the aggnet job, then stop gloo
        (and NCCL)."""
        self._close_client()
        if self._nccl is not None:
            self._nccl.shutdown()
        self._gloo.shutdown()

    def abort(self) -> None:
        self._close_client()
        if self._nccl is not None:
            self._nccl.abort()
        self._gloo.abort()

    # -- routing ------------------------------------------------------------------

    def _route(self, what: str, tensors, op) -> bool:
        """True: aggnet carries it; False: the delegate does (gloo, or NCCL
        for CUDA tensors); raises what neither can."""
        name = op.op.name if hasattr(op, "op") else str(op)
        for t in tensors:
            if t.device.type not in ("cpu", "cuda"):
                raise UnsupportedCollective(
                    f"aggnet backend: {what} of a {t.device.type} tensor; the aggnet backend serves CPU and CUDA "
                    f"tensors (copy the tensor to one of them)")
        if name == "PREMUL_SUM":
            raise UnsupportedCollective(
                f"aggnet backend: {what} with ReduceOp.PREMUL_SUM; neither aggnet nor gloo supports it: multiply "
                f"the tensor by the factor and use ReduceOp.SUM (or ReduceOp.AVG)")
        if name == "AVG":
            bad = sorted({str(t.dtype) for t in tensors if t.is_sparse or t.dtype not in _FLOATS})
            if bad:
                raise UnsupportedCollective(
                    f"aggnet backend: {what} with ReduceOp.AVG of {', '.join(bad)} tensors; the backend averages "
                    f"floating-point tensors, or int8, uint8, int32 and int64 tensors (dense) all in one call: use "
                    f"ReduceOp.SUM and divide by the world size")
        return name in _OPS and all(
            not t.is_sparse and t.dtype in _DTYPES and not (name == "AVG" and t.dtype == torch.int32) for t in tensors)

    def _options(self, opts, kind):
        return opts if opts is not None else kind()

    # -- all-reduce -----------------------------------------------------------------

    def _integer_average(self, what: str, tensors, opts, options_kind, run_sum):
        """``AVG`` of integer tensors as NCCL does it: the sum, then each
        element divided by the world size, truncated toward zero."""
        sum_opts = options_kind()
        sum_opts.reduceOp = dist.ReduceOp.SUM
        sum_opts.timeout = opts.timeout
        carried = self._route(what, tensors, sum_opts.reduceOp)
        work = run_sum(tensors, sum_opts)
        world = self._world

        def divide(f):
            f.value()  # the sum's error, if it failed
            for t in tensors:
                if carried and self._staged(t):  # on the staging's stream, waited for as its sum was
                    self._stager(t.device).after_result(lambda t=t: t.div_(world, rounding_mode="trunc"))
                else:
                    # the delegate's sum (gloo's or NCCL's CUDA future): this
                    # callback's stream is the one that waits for it
                    t.div_(world, rounding_mode="trunc")
            return list(tensors)

        return AggnetWork(work.get_future().then(divide), f"{what} (integer average) on rank {self._rank}",
                          self._timeout, getattr(work, "_failure", None))

    def allreduce(self, tensors, opts=None):
        opts = self._options(opts, dist.AllreduceOptions)
        if _integer_avg(tensors, opts.reduceOp):
            return self._integer_average("all_reduce", tensors, opts, dist.AllreduceOptions, self.allreduce)
        if not self._route("all_reduce", tensors, opts.reduceOp):
            return self._delegated(tensors).allreduce(tensors, opts)
        op = _OPS[opts.reduceOp.op.name]
        return self._submit("all_reduce", tensors, [(t, lambda t=t: self._allreduce_one(t, op)) for t in tensors])

    def allreduce_coalesced(self, tensors, opts=None):
        opts = self._options(opts, dist.AllreduceCoalescedOptions)
        if _integer_avg(tensors, opts.reduceOp):
            return self._integer_average("all_reduce_coalesced", tensors, opts, dist.AllreduceCoalescedOptions,
                                         self.allreduce_coalesced)
        if not self._route("all_reduce_coalesced", tensors, opts.reduceOp):
            return self._delegated(tensors).allreduce_coalesced(tensors, opts)
        op = _OPS[opts.reduceOp.op.name]
        return self._submit("all_reduce_coalesced", tensors,
                            [(t, lambda t=t: self._allreduce_one(t, op)) for t in tensors])

    def _stager(self, device: torch.device) -> Stager:
        shared = getattr(self.client, "takes_shared", False)
        with self._lock:
            stager = self._stagers.get(device)
            if stager is None:
                stager = self._stagers[device] = Stager(device, shared=shared, order=self._order,
                                                        through_host=True if self.stage_cpu_tensors else None)
            return stager

    def _staged(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes through :mod:`aggnet.torch.staging` (a device
        tensor; a CPU one too under ``stage_cpu_tensors``)."""
        return t.device.type != "cpu" or self.stage_cpu_tensors

    def _key(self, codec: str | None, size) -> int | None:
        """The key of a round of ``size`` (an all-reduce's element count, a
        reduce-scatter's share bounds) under ``codec``: an int32 one carries
        its exponents from an earlier round of its size
        (:mod:`aggnet.torch.scale_keys`); others need none (without a key,
        rounds spread over the shards by their number). Keyed whatever
        ``predict_scale`` says, as the DDP hook's buckets are: ranks that set
        it differently then meet the client's carry-or-agree check, which
        names the setting, instead of a key mismatch."""
        if codec != "int32":
            return None
        return self._scale_keys.key(size)

    def _allreduce_one(self, t: torch.Tensor, op: str):
        """(aggnet future, what to do once it is done) for one tensor."""
        if self._staged(t):
            return self._allreduce_staged(t, op)
        work = _contiguous(t.detach())
        arr, hint = tensor_view(work)
        client, codec = self.client, self.codec if t.dtype == torch.float32 else None
        key = self._key(codec, arr.size)
        fut = self._order.call(lambda: client.allreduce(arr, op=op, codec=codec, key=key, _wire_hint=hint))

        def finish():
            if not t.is_contiguous():  # the result went to a contiguous copy
                t.detach().copy_(work)
        return fut, finish

    def _allreduce_staged(self, t: torch.Tensor, op: str):
        """A device tensor through the DDP hook's staging
        (:mod:`aggnet.torch.staging`): encoded on the device, sent from
        pinned memory, decoded back on the device off the caller's stream."""
        stager = self._stager(t.device)
        work = _contiguous(t.detach())
        codec = self.codec if t.dtype == torch.float32 else None
        client = self.client
        staged = stager.stage(work, codec=codec, op=op, world=self._world, check_finite=False,
                              block=quantize_block(client, codec, work.dtype))
        key = self._key(codec, work.numel())
        fut = stager.submit(staged, lambda arr, **options: client.allreduce(arr, op=staged.op, codec=staged.codec,
                                                                            key=key, **options))
        fut.add_done_callback(lambda f: f.exception() is not None and stager.release(staged))

        def finish():
            stager.unstage(staged)
            if not t.is_contiguous():  # the result went to a contiguous copy
                stager.after_result(lambda: t.detach().copy_(work))
        return fut, finish

    # -- reduce-scatter ---------------------------------------------------------------

    def reduce_scatter_single(self, output, input, opts=None):
        opts = self._options(opts, dist.ReduceScatterOptions)
        if input.numel() != output.numel() * self._world:
            raise ValueError(f"aggnet backend: reduce_scatter_tensor takes an input of world_size x output elements: "
                             f"{self._world} x {output.numel()}, got {input.numel()}")
        n = output.numel()
        bounds = [r * n for r in range(self._world + 1)]
        if not self._route("reduce_scatter_tensor", [output, input], opts.reduceOp) or output.dtype != input.dtype:
            return self._gloo_reduce_scatter("reduce_scatter_tensor", [(output, input, bounds)], opts)
        op = _OPS[opts.reduceOp.op.name]
        return self._submit("reduce_scatter_tensor", [output],
                            [(output, lambda: self._reduce_scatter_one(input, output, bounds, op))])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = self._options(opts, dist.ReduceScatterOptions)
        flat_inputs = [t for ts in input_tensors for t in ts]
        to_gloo = not self._route("reduce_scatter", list(output_tensors) + flat_inputs, opts.reduceOp) or \
            len({t.dtype for t in list(output_tensors) + flat_inputs}) > 1
        parts = []
        shares = []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self._world or ins[self._rank].numel() != out.numel():
                raise ValueError(f"aggnet backend: reduce_scatter takes {self._world} input tensors per output, the "
                                 f"one of rank {self._rank} as large as the output; got {len(ins)} inputs of "
                                 f"{[t.numel() for t in ins]} elements for {out.numel()}")
            sizes = [t.numel() for t in ins]
            bounds = [sum(sizes[:r]) for r in range(self._world + 1)]
            # one contiguous buffer of every rank's part, as the aggregator cuts it
            flat = torch.cat([t.detach().reshape(-1) for t in ins])
            shares.append((out, flat, bounds))
            if to_gloo:
                continue
            op = _OPS[opts.reduceOp.op.name]
            parts.append((out, lambda flat=flat, out=out, bounds=bounds:
                          self._reduce_scatter_one(flat, out, bounds, op)))
        if to_gloo:
            return self._gloo_reduce_scatter("reduce_scatter", shares, opts)
        return self._submit("reduce_scatter", output_tensors, parts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = self._options(opts, dist.ReduceScatterOptions)
        shares = []
        for out, inp in zip(outputs, inputs):
            if inp.numel() != out.numel() * self._world:
                raise ValueError(f"aggnet backend: reduce_scatter_tensor_coalesced takes inputs of world_size x "
                                 f"output elements: {self._world} x {out.numel()}, got {inp.numel()}")
            shares.append((out, inp, [r * out.numel() for r in range(self._world + 1)]))
        if not self._route("reduce_scatter_tensor_coalesced", list(outputs) + list(inputs), opts.reduceOp) or \
                any(o.dtype != i.dtype for o, i in zip(outputs, inputs)):
            return self._gloo_reduce_scatter("reduce_scatter_tensor_coalesced", shares, opts)
        op = _OPS[opts.reduceOp.op.name]
        parts = [(out, lambda inp=inp, out=out, bounds=bounds: self._reduce_scatter_one(inp, out, bounds, op))
                 for out, inp, bounds in shares]
        return self._submit("reduce_scatter_tensor_coalesced", outputs, parts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_one(self, input: torch.Tensor, output: torch.Tensor, bounds: list[int], op: str):
        client = self.client
        if self._staged(input):
            return self._reduce_scatter_staged(input, output, bounds, op)
        src = _contiguous(input.detach())
        dst = _contiguous(output.detach())
        src_arr, hint = tensor_view(src)
        dst_arr, _ = tensor_view(dst)
        codec = self.codec if input.dtype == torch.float32 else None
        mine = slice(bounds[self._rank], bounds[self._rank + 1])
        if client.owner_results:
            key = self._key(codec, tuple(bounds))
            fut = self._order.call(lambda: client.reduce_scatter(src_arr.reshape(-1), dst_arr.reshape(-1), bounds,
                                                                 op=op, codec=codec, key=key, _wire_hint=hint))
            whole = None
        else:
            # a switch, or a rack of a hierarchy: all-reduce a copy, keep this rank's share
            whole = src.reshape(-1).clone()
            whole_arr, _ = tensor_view(whole)
            key = self._key(codec, whole_arr.size)
            fut = self._order.call(lambda: client.allreduce(whole_arr, op=op, codec=codec, key=key,
                                                            _wire_hint=hint))

        def finish():
            if whole is not None:
                dst.reshape(-1).copy_(whole[mine])
            if not output.is_contiguous():
                output.detach().copy_(dst)
        return fut, finish

    def _reduce_scatter_staged(self, input: torch.Tensor, output: torch.Tensor, bounds: list[int], op: str):
        """A device tensor's reduce-scatter through the staging its
        all-reduce takes: the input goes to pinned memory off the caller's
        stream, and only this rank's share comes back to the device. The
        share is received into the staged input's own elements of it, so an
        ``shm://`` service writes it there in place (a switch or a rack
        all-reduces the staged copy instead: the same share comes back)."""
        stager = self._stager(input.device)
        client = self.client
        codec = self.codec if input.dtype == torch.float32 else None
        # int32 is quantized on the device, share by share as the client
        # chunks them, where the client sends each rank its share alone
        # (a switch or a rack quantizes the all-reduced copy itself)
        block = quantize_block(client, codec, input.dtype) if client.owner_results else None
        staged = stager.stage(_contiguous(input.detach()), codec=codec, op=op, world=self._world, check_finite=False,
                              block=block, bounds=bounds)
        mine = slice(bounds[self._rank], bounds[self._rank + 1])
        if client.owner_results:
            key = self._key(codec, tuple(bounds))

            def send(arr, **options):
                return client.reduce_scatter(arr, arr[mine], bounds, op=staged.op, codec=staged.codec, key=key,
                                             **options)
        else:
            key = self._key(codec, input.numel())

            def send(arr, **options):
                return client.allreduce(arr, op=staged.op, codec=staged.codec, key=key, **options)
        fut = stager.submit(staged, send)
        fut.add_done_callback(lambda f: f.exception() is not None and stager.release(staged))
        dst = _contiguous(output.detach())

        def finish():
            stager.unstage(staged, mine, dst.view(-1))
            if not output.is_contiguous():  # the result went to a contiguous copy
                stager.after_result(lambda: output.detach().copy_(dst))
        return fut, finish

    def _gloo_reduce_scatter(self, what: str, shares, opts) -> AggnetWork:
        """A reduce-scatter aggnet does not carry, as gloo's all-reduce of a
        copy of which this rank keeps its share: gloo's own reduce-scatter
        gives a work without a future, which DDP and FSDP2 need."""
        ar = dist.AllreduceOptions()
        ar.reduceOp = opts.reduceOp
        futures = []
        for out, inp, bounds in shares:
            whole = inp.detach().reshape(-1).clone()
            mine = whole[bounds[self._rank]:bounds[self._rank + 1]]
            fut = self._delegated([whole]).allreduce([whole], ar).get_future()
            futures.append(fut.then(lambda f, out=out, mine=mine: out.detach().copy_(mine.view_as(out))))
        result = [out for out, _, _ in shares]

        def finish(f):
            for part in f.value():
                part.wait()  # raises the first part's error
            return result
        done = torch.futures.collect_all(futures).then(finish)
        return AggnetWork(done, f"{what} on rank {self._rank} (gloo)", self._timeout)

    # -- gloo's collectives ---------------------------------------------------------------
    # torch's trampoline for a Python process group holds the GIL while it
    # runs the base class's version of these (the ones it lets a subclass
    # override); the base version queues the op on gloo, whose worker may be
    # waiting for the GIL to free a finished op's tensors: a deadlock. Handed
    # to the plain gloo group here, each goes through a binding that lets
    # the GIL go first. (The others never take the GIL on their way to gloo.)

    def broadcast(self, tensors, opts=None):
        return self._delegated(tensors).broadcast(tensors, self._options(opts, dist.BroadcastOptions))

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._delegated(input_tensors).allgather(output_tensors, input_tensors,
                                                         self._options(opts, _c10d.AllgatherOptions))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        # torch 2.11 binds it under its older name only
        group = self._delegated(inputs)
        gather = getattr(group, "all_gather_single_coalesced", None) or group.allgather_into_tensor_coalesced
        return gather(outputs, inputs, self._options(opts, _c10d.AllgatherOptions))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._delegated([input]).all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                          self._options(opts, dist.AllToAllOptions))

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._gloo.barrier(self._options(opts, dist.BarrierOptions))

    def send(self, tensors, dst_rank, tag=0):
        return self._delegated(tensors).send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag=0):
        return self._delegated(tensors).recv(tensors, src_rank, tag)

    def _delegated(self, tensors):
        """The group a collective aggnet does not carry goes to: NCCL's for
        dense CUDA tensors where ``cuda_delegate="nccl"``, else gloo's
        (sparse tensors too: NCCL sums none)."""
        if self._delegate is self._gloo or any(t.is_sparse or t.device.type != "cuda" for t in tensors):
            return self._gloo
        return self._delegate

    # -- futures -------------------------------------------------------------------------

    def _submit(self, what: str, result, parts) -> AggnetWork:
        """Start every part (a callable giving (aggnet future, finish)) and
        return one work that completes when all are done and finished."""
        what = f"{what} on rank {self._rank} (job {self.job!r})"
        started = [start() for _, start in parts]
        finishes = dict(started)
        failure: list[BaseException] = []

        def value(all_done) -> list:
            first = None
            # in the order the parts finished: the error raised is the first
            # to happen; every part that succeeded still lands in its tensor
            for fut in all_done.result():
                try:
                    fut.result()
                    finishes[fut]()
                except BaseException as exc:
                    first = first if first is not None else exc
            if first is not None:
                raise first
            return list(result)

        def context(exc: BaseException) -> BaseException:
            if isinstance(exc, AggnetError):  # say which collective the client's error is about
                return type(exc)(f"aggnet backend: {what}: {exc}")
            return exc

        out = torch_future(when_all([fut for fut, _ in started]), value, context, errors=failure)
        return AggnetWork(out, what, self._timeout, failure)


def _create(options, pg_options) -> AggnetProcessGroup:
    """Called by torch for every process group created with this backend."""
    if pg_options is not None and not isinstance(pg_options, ClientConfig):
        raise TypeError(f"the aggnet backend takes an aggnet.ClientConfig as pg_options, got "
                        f"{type(pg_options).__name__}")
    _refuse_mixed(sys._getframe(1))
    return AggnetProcessGroup(options.store, options.group_rank, options.group_size, options.timeout,
                              group_name=str(options.group_id), config=pg_options,
                              global_ranks=getattr(options, "global_ranks_in_group", None))


def _nccl_backend(store, rank: int, world_size: int, timeout, group_name: str, global_ranks):
    """NCCL for the CUDA collectives aggnet hands on, made as torch makes
    a group's own (a store prefix of its own, the group's timeout)."""
    if not dist.is_nccl_available():
        raise ValueError(f"aggnet backend: cuda_delegate='nccl' (AGGNET_CUDA_DELEGATE) but this torch "
                         f"({torch.__version__}) has no NCCL; leave it unset for gloo, or install torch's CUDA build")
    if not torch.cuda.is_available():
        raise ValueError("aggnet backend: cuda_delegate='nccl' (AGGNET_CUDA_DELEGATE) but torch sees no CUDA GPU "
                         "here; leave it unset for gloo")
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    opts.group_name = group_name
    if global_ranks:
        opts.global_ranks_in_group = list(global_ranks)
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size, opts)


def _refuse_mixed(caller) -> None:
    """``"cpu:aggnet,cuda:nccl"``: torch takes the Python process group it
    gets for one device as the whole group and creates no backend for the
    others, so the other backend would be silently dropped. The backend
    string is only in torch's own frame (``backend_config``); where a torch
    version names it otherwise, nothing is checked."""
    config = caller.f_locals.get("backend_config") if caller is not None else None
    try:
        pairs = dict(config.get_device_backend_map())
    except Exception:
        return
    others = {device: str(name) for device, name in pairs.items() if str(name).lower() != BACKEND_NAME}
    if others:
        named = ",".join(f"{device}:{name}" for device, name in pairs.items())
        raise ValueError(
            f"aggnet backend: {named!r} mixes aggnet with {', '.join(sorted(set(others.values())))}; torch uses "
            f"aggnet's process group for every device then and would drop the other backend: use backend='aggnet' "
            f"(CPU and CUDA tensors through aggnet; AGGNET_CUDA_DELEGATE=nccl hands the CUDA collectives aggnet "
            f"leaves to NCCL), or 'nccl' with aggnet's DDP hook (aggnet.torch.allreduce_hook)")


def register() -> None:
    """Make ``"aggnet"`` a torch.distributed backend (done on ``import aggnet.torch``)."""
    if not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    global _torch_monitored_barrier
    if _torch_monitored_barrier is None:
        _torch_monitored_barrier = dist.monitored_barrier
        dist.monitored_barrier = _c10d_module().monitored_barrier = monitored_barrier


_torch_monitored_barrier = None


def _c10d_module():
    import torch.distributed.distributed_c10d as c10d

    return c10d


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    """``dist.monitored_barrier`` on aggnet groups as on gloo's: torch
    serves it only to groups whose backend is named gloo, and an aggnet
    group's barrier is its gloo group's, so this one hands it there. It
    takes the place of ``torch.distributed.monitored_barrier`` when
    aggnet.torch is imported (code that imported the function by name
    before that keeps torch's); every other group goes to torch's own."""
    c10d = _c10d_module()
    pg = c10d._get_default_group() if group is None and dist.is_initialized() else group
    if not isinstance(pg, AggnetProcessGroup):
        return _torch_monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
    if timeout is None:
        timeout = c10d._get_default_timeout(dist.Backend.GLOO)
    elif isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    return pg._gloo.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def init_process_group(**kwargs) -> None:
    """``dist.init_process_group("aggnet", **kwargs)`` (torchrun's env://
    rendezvous by default), for frameworks that keep the group they find
    instead of taking a backend by name: call it before creating
    Accelerate's ``Accelerator`` or the HF ``Trainer``'s
    ``TrainingArguments`` (their own backend setting accepts only names
    they know). Nothing to do where an aggnet group exists already."""
    register()
    if dist.is_initialized():
        backend = str(dist.get_backend())
        if backend != BACKEND_NAME:
            raise RuntimeError(f"torch.distributed is already initialized with the {backend!r} backend; call "
                               f"aggnet.torch.init_process_group() before anything initializes it, or "
                               f"destroy_process_group() first")
        return
    dist.init_process_group(BACKEND_NAME, **kwargs)
