"""Stale-gradient data parallelism: the all-reduce of a step's gradients
runs while the next steps compute, and is applied ``s`` steps late.

Synchronous data parallelism waits for every bucket's all-reduce before
the optimizer steps; on a slow link that wait is the step. With
``AggnetState(staleness=s)`` the DDP hook collects step t's buckets,
starts one all-reduce of them all at the last, and hands DDP, in their
place, the all-reduced gradients of step t - s, which have had s steps of
compute to arrive. Every rank
applies the same gradients at the same step, so ranks stay bit-identical;
the price is that a gradient lands on weights s updates newer than the
ones it was computed at.

With ``predict=True`` (SpecTrain's idea carried over to data
parallelism) the forward and backward of step t run at the weights
predicted for step t + s, Ŵ = W_t - s·η·v (:mod:`aggnet.pipeline.predict`),
so the gradient fits the weights it will be applied to.

:class:`StaleStep` wraps a training step: prediction in, the backward,
the weights back, the optimizer step (skipped while the first s steps'
all-reduces are still on their way)::

    state = AggnetState(staleness=1, predict=True)
    ddp.register_comm_hook(state, allreduce_hook)
    stale = StaleStep(ddp, optimizer, state)
    for x, y in data:
        with stale.step():
            loss_fn(ddp(x), y).backward()
    stale.finish()

:func:`emulate` is the same training in one process (every rank's model
side by side), equal to the distributed run bit for bit with two ranks;
the experiments use it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from aggnet.errors import AggnetError
from aggnet.pipeline.emulator import average
from aggnet.pipeline.predict import WeightPredictor
from aggnet.torch.futures import torch_future, when_all
from aggnet.torch.staging import copy_to_host, wait_event


class _Sent:
    """One bucket of one step on its way: the client's future, the copy it
    all-reduces, and where each parameter's gradient sits in it (buckets
    are rebuilt after DDP's first step, so later steps look gradients up
    by parameter, not by bucket)."""

    def __init__(self, future, staging: torch.Tensor, param_ids: list, sizes: list):
        self.future, self.staging = future, staging
        self.at = {}
        offset = 0
        for pid, n in zip(param_ids, sizes):
            self.at[pid] = (offset, n)
            offset += n


class StaleQueue:
    """The all-reduces in flight for a state with ``staleness`` s: step t's
    buckets, kept until step t + s has taken them."""

    def __init__(self, staleness: int):
        self.staleness = staleness
        self.step = 0  #: steps whose last bucket the hook has seen
        self.sent: dict[int, list[_Sent]] = {}
        #: this step's buckets so far: (copy in host memory, the event that
        #: says it is complete or None, parameter ids, sizes)
        self.parts: list = []
        self.lock = threading.Lock()

    @property
    def applies(self) -> bool:
        """Whether the step now running gets all-reduced gradients (the first
        s get zeros: nothing has come back yet)."""
        return self.step >= self.staleness

    def wait_all(self, timeout: float) -> None:
        for entries in list(self.sent.values()):
            for e in entries:
                e.future.result(timeout=timeout)


def allreduce_stale(state, bucket) -> torch.futures.Future:
    """The hook's path for ``staleness`` > 0: keep a copy of this step's
    bucket (the last bucket sends the whole step), and answer with the same
    parameters' all-reduced gradients of s steps ago."""
    queue: StaleQueue = state.stale_queue
    buf = bucket.buffer()
    if buf.is_sparse:
        raise AggnetError("aggnet DDP hook: staleness does not apply to sparse gradients; use dense embeddings "
                          "(sparse=False) or staleness=0")
    params = bucket.parameters()
    param_ids = [p.data_ptr() for p in params]
    sizes = [p.numel() for p in params]
    if buf.dtype != torch.float32:
        raise AggnetError(f"aggnet DDP hook: staleness needs float32 gradients, bucket {bucket.index()} holds "
                          f"{buf.dtype}; train in float32 (AMP keeps float32 gradients) or use staleness=0")
    with queue.lock:
        t = queue.step
        # (pinned, without blocking, for a device's: the step's all-reduce
        # waits for the copies on the client's queue thread)
        copy, copied = copy_to_host(buf.detach(), always=True)
        queue.parts.append((copy, copied, param_ids, sizes))
        old = queue.sent.get(t - queue.staleness, [])
        if bucket.is_last():
            # the whole step in one all-reduce: nothing waits for it before
            # the next step's end, and one large all-reduce moves faster than
            # a queue of DDP's buckets on every aggregator path
            parts, queue.parts = queue.parts, []
            all_ids = [i for p in parts for i in p[2]]
            all_sizes = [n for p in parts for n in p[3]]
            staging = torch.empty(sum(all_sizes), dtype=torch.float32, pin_memory=buf.is_cuda)
            # keyed by the step modulo staleness + 1: the int32 codec carries
            # a round's exponents from the last round of its key, which is
            # then step t - s - 1's, awaited at the last step (with one key
            # for all it would wait for step t - 1's, and the pipeline with it)
            client, round_key = state.client, t % (queue.staleness + 1)

            def send():
                # on the client's queue thread: the copies of a device's
                # buckets are waited for there, not on the training thread
                for _, copied_, _, _ in parts:
                    wait_event(copied_, f"copying a bucket from {buf.device}")
                # one memcpy a part: torch's cat on this thread would start
                # an OpenMP team of its own beside the training's threads
                np.concatenate([p[0].numpy() for p in parts], out=staging.numpy())
                return client.allreduce(staging.numpy(), op=state.op, codec=state.codec, key=round_key)

            future = state._order.call_later(send)
            queue.sent[t] = [_Sent(future, staging, all_ids, all_sizes)]
            queue.step += 1
            queue.sent.pop(t - queue.staleness, None)
    if t < queue.staleness:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buf.zero_())
        return done
    # each of this bucket's parameters, in the sent copy of step t - s
    where = []
    for pid in param_ids:
        hit = next(((e, e.at[pid]) for e in old if pid in e.at), None)
        if hit is None:
            raise AggnetError(f"aggnet DDP hook: a parameter of bucket {bucket.index()} was not all-reduced "
                              f"{queue.staleness} step(s) ago; stale gradients need every step to produce "
                              f"gradients for the same parameters (find_unused_parameters is not supported)")
        where.append(hit)
    needed = list({id(e): e for e, _ in where}.values())

    stager = state.stager(buf.device)

    def fill(f) -> torch.Tensor:
        for one in f.result():
            try:
                one.result()
            except AggnetError as exc:
                raise type(exc)(f"aggnet DDP hook (staleness {queue.staleness}), bucket {bucket.index()} on "
                                f"rank {state.rank}: {exc}") from None
        def copy_back():
            offset = 0
            for (e, (at, n)), size in zip(where, sizes):
                buf[offset:offset + size].copy_(e.staging[at:at + n], non_blocking=stager.cuda)
                offset += size

        # after the bucket's copy out of ``buf``, which reads it first; the
        # CUDA future makes whoever waits on it wait for this on the device
        stager.back_on_device(copy_back, after=copied)
        return buf

    return torch_future(when_all([e.future for e in needed]), fill, devices=[buf.device] if buf.is_cuda else None)


class StaleStep:
    """A training step with stale gradients: ``model`` is the DDP model whose
    hook state is ``state`` (``AggnetState(staleness=s)``), ``optimizer``
    updates its parameters. With ``state.predict`` each step computes at
    the weights predicted s updates ahead."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state):
        if not getattr(state, "staleness", 0):
            raise ValueError("StaleStep needs AggnetState(staleness=s) with s >= 1 registered as the model's hook")
        self.model, self.optimizer, self.state = model, optimizer, state
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.predictor = WeightPredictor(self.params, optimizer) if state.predict else None
        #: optimizer steps taken (the first ``staleness`` steps take none)
        self.updates = 0

    @contextlib.contextmanager
    def step(self):
        """Forward and backward inside; the optimizer step on the way out."""
        saved = None
        if self.predictor is not None:
            ahead = self.predictor.predicted(self.state.staleness)
            saved = [p.detach().clone() for p in self.params]
            with torch.no_grad():
                for p, w in zip(self.params, ahead):
                    p.copy_(w)
        applies = self.state.stale_queue.applies
        try:
            yield
        finally:
            if saved is not None:
                with torch.no_grad():
                    for p, w in zip(self.params, saved):
                        p.copy_(w)
        if applies:
            if self.predictor is not None:
                self.predictor.before_step()
            self.optimizer.step()
            if self.predictor is not None:
                self.predictor.after_step()
            self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self, timeout: float | None = None) -> None:
        """Wait for the all-reduces still on their way (their gradients are
        not applied: training ended first)."""
        self.state.stale_queue.wait_all(timeout if timeout is not None else self.state.config.timeout * 2 + 10)


def emulate(models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer], batches,
            loss_fn: Callable, *, staleness: int, predict: bool = False,
            on_step: Callable[[int], None] | None = None) -> list[list[float]]:
    """Stale-gradient data parallelism in one process: ``models[r]`` (equal
    copies) trains on ``batches[r]``; each step's gradients are averaged
    over the copies and applied ``staleness`` steps later (0: synchronous
    training). Returns each copy's losses. ``on_step(t)`` after each step
    (evaluation, progress)."""
    replicas = len(models)
    params = [[p for p in m.parameters() if p.requires_grad] for m in models]
    predictors = [WeightPredictor(ps, o) for ps, o in zip(params, optimizers)] if predict and staleness else None
    waiting: list[list[torch.Tensor]] = []
    losses: list[list[float]] = [[] for _ in range(replicas)]
    for t, step_batches in enumerate(zip(*batches)):
        grads = []
        for r, (x, y) in enumerate(step_batches):
            saved = None
            if predictors is not None:
                saved = [p.detach().clone() for p in params[r]]
                with torch.no_grad():
                    for p, w in zip(params[r], predictors[r].predicted(staleness)):
                        p.copy_(w)
            optimizers[r].zero_grad(set_to_none=True)
            loss = loss_fn(models[r](x), y)
            loss.backward()
            losses[r].append(float(loss.detach()))
            grads.append(torch.cat([p.grad.reshape(-1) for p in params[r]]))
            if saved is not None:
                with torch.no_grad():
                    for p, w in zip(params[r], saved):
                        p.copy_(w)
        waiting.append(average(grads))
        if t >= staleness:
            mean = waiting.pop(0)
            for r in range(replicas):
                at = 0
                for p in params[r]:
                    p.grad = mean[at:at + p.numel()].view_as(p).clone()
                    at += p.numel()
                if predictors is not None:
                    predictors[r].before_step()
                optimizers[r].step()
                if predictors is not None:
                    predictors[r].after_step()
        if on_step is not None:
            on_step(t)
    return losses
