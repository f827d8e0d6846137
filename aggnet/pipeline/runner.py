"""The asynchronous pipeline across processes: one stage per rank,
activations and their gradients sent between neighbours, each stage's
gradients averaged over its copies through aggnet before every update.

Each rank drives its :class:`~aggnet.pipeline.stage.Stage` through the
stage's order of passes (:func:`aggnet.pipeline.schedule.stage_order`).
Sends are ``isend`` (the next pass starts while a tensor is on the wire);
receives run on one background thread per neighbour, which takes that
neighbour's tensors in order as they arrive, so a pass never waits for a
transfer that could have happened during the previous one. Every tensor
travels behind a small header (its batch and shape): batches may differ
in size, and a tensor arriving for the wrong batch is caught, not
silently used.

The pipeline's ranks talk over the default torch.distributed process
group (gloo); a data-parallel stage's all-reduce goes through aggnet, one
job per stage (``<job>-stage<k>``), so a topology's placement
(:func:`aggnet.parallel.build_layout`) keeps each stage's gradients at its
rack's aggregator.

A stage on a GPU computes there; what crosses to a neighbour or to the
aggregator goes through host memory (gloo sends host tensors only, and
aggregators sum in host memory), received on the host and moved to the
device by the stage's own thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from aggnet.errors import AggregationTimeout
from aggnet.pipeline.schedule import stage_order
from aggnet.pipeline.stage import Stage

_ACTIVATION, _GRADIENT = 11, 12
_HEADER = 10  # batch, ndim, up to 8 dimensions
_MAX_PENDING_SENDS = 16


class AggnetReducer:
    """A stage's data-parallel average through an aggnet job: one client,
    connected on the first update. A device's gradients go through one
    page-locked host buffer, kept for the next update."""

    def __init__(self, address: str | None = None, *, job: str, rank: int, world_size: int,
                 codec: str | None = None, config=None, **placement):
        self.address, self.codec, self.config = address, codec, config
        self.kwargs = {"job": job, "rank": rank, "world_size": world_size, **placement}
        self._client = None
        self._host: torch.Tensor | None = None

    def _on_host(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` itself on the CPU, else its copy in the kept host buffer."""
        if flat.device.type == "cpu":
            return flat
        if self._host is None or self._host.shape != flat.shape or self._host.dtype != flat.dtype:
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        return self._host.copy_(flat)

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        from aggnet.client.base import Client

        if self._client is None:
            self._client = Client(self.address, config=self.config, **self.kwargs)
        host = self._on_host(flat)
        future = self._client.allreduce(host.numpy(), op="avg", codec=self.codec)
        future.result(timeout=self._client.config.timeout * 2 + 10)
        return flat.copy_(host) if host is not flat else flat

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _Inbox:
    """Tensors from one neighbour, received in order on a thread of its own."""

    def __init__(self, peer: int, tag: int, count: int, what: str):
        self.peer, self.tag, self.what = peer, tag, what
        self.items: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._receive, args=(count,), daemon=True,
                                       name=f"aggnet-pipeline-recv-{peer}")
        self.thread.start()

    def _receive(self, count: int) -> None:
        try:
            for _ in range(count):
                header = torch.empty(_HEADER, dtype=torch.int64)
                dist.recv(header, src=self.peer, tag=self.tag)
                batch, ndim = int(header[0]), int(header[1])
                tensor = torch.empty([int(d) for d in header[2:2 + ndim]], dtype=torch.float32)
                dist.recv(tensor, src=self.peer, tag=self.tag)
                self.items.put((batch, tensor))
        except BaseException as exc:  # reaches the stage's thread, which names the peer
            self.items.put((None, exc))

    def get(self, batch: int, timeout: float) -> torch.Tensor:
        try:
            got, tensor = self.items.get(timeout=timeout)
        except queue.Empty:
            raise AggregationTimeout(
                f"pipeline: waited {timeout:g}s for the {self.what} of batch {batch} from rank {self.peer}; "
                f"is that rank alive and running the same schedule and batches?") from None
        if got is None:
            first = str(tensor).strip().splitlines()[0] if str(tensor).strip() else type(tensor).__name__
            raise RuntimeError(f"pipeline: receiving the {self.what} of batch {batch} from rank {self.peer} "
                               f"failed; is that rank alive? ({first})") from None
        if got != batch:
            raise RuntimeError(f"pipeline: rank {self.peer} sent the {self.what} of batch {got} where batch {batch} "
                               f"was due; every stage must run the same mode and number of batches")
        return tensor


def _send_failed(what: str, batch: int, peer: int, exc: BaseException) -> RuntimeError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return RuntimeError(f"pipeline: sending the {what} of batch {batch} to rank {peer} failed; is that rank alive "
                        f"and running the same schedule? ({first})")


class StageRunner:
    """Rank ``ranks[k]`` of a pipeline running ``stage`` (stage k).

    ``ranks``: the global ranks of this replica's stages, in stage order;
    ``reducer``: the data-parallel average of the stage's flat gradients
    (an :class:`AggnetReducer`, or None for a single replica);
    ``timeout``: seconds to wait for a neighbour's tensor."""

    def __init__(self, stage: Stage, ranks, *, reducer=None, timeout: float = 300.0):
        if not dist.is_initialized():
            raise RuntimeError("the pipeline needs torch.distributed initialized over its ranks first "
                               "(torchrun, then dist.init_process_group('gloo'))")
        if len(ranks) != stage.stages:
            raise ValueError(f"{len(ranks)} ranks for a pipeline of {stage.stages} stages")
        if dist.get_rank() != ranks[stage.index]:
            raise ValueError(f"stage {stage.index} belongs on rank {ranks[stage.index]}, not on rank {dist.get_rank()}")
        self.stage, self.ranks, self.reducer, self.timeout = stage, list(ranks), reducer, timeout
        k = stage.index
        self.prev = self.ranks[k - 1] if k > 0 else None
        self.next = self.ranks[k + 1] if k < stage.stages - 1 else None
        self._sends: deque = deque()
        #: seconds spent waiting on neighbours and on the data-parallel all-reduce
        self.wait_seconds = {"receive": 0.0, "reduce": 0.0}

    def _send(self, batch: int, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.detach().to("cpu", torch.float32).contiguous()
        if tensor.dim() > _HEADER - 2:
            raise ValueError(f"pipeline: a stage's output may have at most {_HEADER - 2} dimensions")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = batch, tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        what = "activations" if tag == _ACTIVATION else "gradient"
        for t in (header, tensor):
            try:
                work = dist.isend(t, peer, tag=tag)
            except RuntimeError as exc:
                raise _send_failed(what, batch, peer, exc) from None
            self._sends.append((work, t, what, batch, peer))
        while len(self._sends) > _MAX_PENDING_SENDS:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, _, what, batch, peer = self._sends.popleft()
        try:
            work.wait()
        except RuntimeError as exc:
            raise _send_failed(what, batch, peer, exc) from None

    def run(self, batches) -> list[float]:
        """Train on ``batches`` (a sequence of (inputs, targets), the same on
        every stage of the pipeline: stage 0 reads the inputs, the last the
        targets; on the host or the stage's device). Returns the per-batch losses at the last stage (empty
        elsewhere)."""
        batches = list(batches)
        stage = self.stage
        device = stage.device
        acts = _Inbox(self.prev, _ACTIVATION, len(batches), "activations") if self.prev is not None else None
        grads = _Inbox(self.next, _GRADIENT, len(batches), "gradient") if self.next is not None else None
        losses = []
        for op in stage_order(stage.index, stage.stages, len(batches), stage.mode):
            i = op.batch
            if op.kind == "F":
                t0 = time.perf_counter()
                x = batches[i][0] if acts is None else acts.get(i, self.timeout)
                self.wait_seconds["receive"] += time.perf_counter() - t0
                target = batches[i][1].to(device) if self.next is None else None
                out = stage.forward(i, x.to(device), target)
                if self.next is not None:
                    self._send(i, out, self.next, _ACTIVATION)
                else:
                    losses.append(float(out))
            else:
                t0 = time.perf_counter()
                g = None if grads is None else grads.get(i, self.timeout).to(device)
                self.wait_seconds["receive"] += time.perf_counter() - t0
                g_in = stage.backward(i, g)
                if self.prev is not None:
                    self._send(i, g_in, self.prev, _GRADIENT)
                if self.reducer is not None:
                    t0 = time.perf_counter()
                    stage.set_flat_gradients(self.reducer(stage.flat_gradients()))
                    self.wait_seconds["reduce"] += time.perf_counter() - t0
                stage.update()
        while self._sends:
            self._wait_oldest()
        return losses
