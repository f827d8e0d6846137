"""Sparse parameters through aggnet's parameter server (the Parallax
hybrid: dense buckets are all-reduced, sparse rows go to row-partitioned
tables on the aggregator hosts, :mod:`aggnet.hosts.sparse`).

Two ways in (docs/torch.md, "Sparse parameters", says when to use which):

* **all-reduce mode**, automatic under the DDP hook: a sparse bucket
  (``nn.Embedding(sparse=True)``) is pushed to an ``allreduce`` table and
  comes back as every worker's rows summed (or averaged); the worker's own
  optimizer then steps, unchanged. Each worker sends its own rows once and
  receives the union, where torch's sparse all-reduce gathers every
  worker's rows to every worker.
* **PS mode**, :class:`ShardedEmbedding`: the table and its optimizer state
  live on the service (SGD, momentum, Adagrad, lazy Adam); a step pulls the
  rows its batch needs and pushes their gradients, so a table larger than
  one worker's memory trains.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from aggnet.client.sparse import SparseClient, SparseTable
from aggnet.torch.futures import torch_future
from aggnet.torch.staging import copy_to_host, wait_event

log = logging.getLogger("aggnet.torch")

__all__ = ["ShardedEmbedding", "sparse_allreduce"]


def supports(buf: torch.Tensor) -> bool:
    """Whether a sparse bucket can take the aggnet path: float32 rows
    indexed by one sparse dimension (an embedding's gradient), on the CPU
    or a GPU. Others keep torch.distributed's sparse all-reduce."""
    return buf.dtype == torch.float32 and buf.sparse_dim() == 1 and buf.device.type in ("cpu", "cuda")


def tables_reachable(state) -> bool:
    """Whether the hook's aggregator can hold sparse tables: a service that
    every worker reaches. Over a switch, or through the racks of a topology,
    sparse buckets keep torch.distributed's path (said once in the log)."""
    client = state.client
    if isinstance(getattr(client, "shards", None), list) and client.members == client.world_size:
        return True
    if not getattr(state, "_sparse_fallback_said", False):
        state._sparse_fallback_said = True
        log.info("aggnet DDP hook, rank %d: sparse buckets go through torch.distributed: %s holds no sparse "
                 "tables every worker reaches (a switch, or racks of a topology)", state.rank, client.address)
    return False


def _client_of(state) -> SparseClient:
    with state._lock:
        sc = getattr(state, "_sparse_client", None)
    if sc is None:
        client = state.client  # connects (takes state._lock)
        with state._lock:
            sc = getattr(state, "_sparse_client", None)
            if sc is None:
                sc = state._sparse_client = SparseClient.of(client)
                state._sparse_tables = {}
    return sc


def sparse_allreduce(state, buf: torch.Tensor) -> torch.futures.Future:
    """A sparse COO bucket summed (``state.sparse_op`` "sum") or averaged
    over every worker through an ``allreduce`` table: the rows of all
    workers at the union of their indices, identical on every rank."""
    sc = _client_of(state)
    shape = tuple(buf.shape)
    rows = shape[0]
    width = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    name = f"ddp-sparse-{rows}x{width}-{state.sparse_op}"
    table = state._sparse_tables.get(name)
    if table is None:
        table = state._sparse_tables[name] = sc.table(name, rows, width, mode="allreduce", op=state.sparse_op)
    device = buf.device
    # a GPU's rows go to pinned memory without blocking the training thread
    idx, idx_copied = copy_to_host(buf._indices()[0])
    vals, vals_copied = copy_to_host(buf._values().detach().reshape(-1, width))

    def send():
        # on the client's queue thread, which waits for those copies
        for copied in (idx_copied, vals_copied):
            wait_event(copied, f"copying a sparse bucket from {device}")
        return table.allreduce(idx.numpy(), vals.numpy())

    def value(f) -> torch.Tensor:
        uniq, summed = f.result()
        rows_of, values = torch.from_numpy(uniq)[None], torch.from_numpy(summed).reshape((uniq.size,) + shape[1:])
        if device.type != "cpu":
            # queued on this thread's stream: the CUDA future makes DDP's
            # stream wait for the copies on the device, not the host
            rows_of, values = rows_of.to(device, non_blocking=True), values.to(device, non_blocking=True)
        return torch.sparse_coo_tensor(rows_of, values, shape, is_coalesced=True, check_invariants=False)

    return torch_future(state._order.call_later(send), value, lambda exc: RuntimeError(
        f"aggnet DDP hook, sparse bucket {shape} on rank {state.rank}: {exc}"),
        devices=[device] if device.type == "cuda" else None)


class ShardedEmbedding(nn.Module):
    """An embedding whose table and optimizer live on the aggnet service.

    ``client``: a connected :class:`aggnet.Client` (or a
    :class:`~aggnet.client.sparse.SparseClient`); every worker creates the
    module with the same arguments. The server applies ``optimizer``
    (``"sgd"``, ``"momentum"``, ``"adagrad"``, ``"adam"``: torch's sparse
    SGD, lazy momentum, sparse Adagrad, SparseAdam) with ``hyper`` (lr,
    momentum, lr_decay, initial_accumulator_value, beta1, beta2, eps) once
    every worker's gradient of a step is in; ``op="avg"`` averages them
    (DDP's semantics), ``"sum"`` sums. The module holds no parameters: leave
    it out of the torch optimizer. A step is forward, backward (which
    pushes the gradient rows), and the next forward (which waits for the
    step to be applied, then pulls).

    ``partitions``: the number of row partitions (default: one per shard),
    or ``"auto"``: every worker creates the module at once and together
    they time steps of a scratch table at a few partition counts, fit
    Parallax's cost model and take its best P (``self.tuning`` holds the
    samples and the fit; rank 0 logs them). ``tune_alpha`` is the fraction
    of the rows one worker's batch touches (tokens per batch / rows for a
    language model), ``tune_steps`` the steps timed per sample.
    """

    def __init__(self, client, name: str, num_embeddings: int, embedding_dim: int, *, optimizer: str = "sgd",
                 op: str = "avg", partitions: int | str | None = None, init: dict | None = None,
                 tune_alpha: float = 0.01, tune_steps: int = 5, **hyper):
        super().__init__()
        self.sparse_client = client if isinstance(client, SparseClient) else SparseClient.of(client)
        self._owns_client = not isinstance(client, SparseClient)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tuning: dict | None = None
        if partitions == "auto":
            partitions = self._tune(name, tune_alpha, tune_steps)
        elif isinstance(partitions, str):
            raise ValueError(f"partitions must be a count, None (one per shard) or 'auto', got {partitions!r}")
        self.table: SparseTable = self.sparse_client.table(
            name, num_embeddings, embedding_dim, mode="ps", optimizer=optimizer, op=op, partitions=partitions,
            init=init if init is not None else {"kind": "normal", "scale": 1.0, "seed": 0}, **hyper)
        self._pending = None  # the last push's future
        self._open: np.ndarray | None = None  # indices of a forward whose gradient is not pushed yet
        self._lock = threading.Lock()

    def _tune(self, name: str, alpha: float, steps: int) -> int:
        from aggnet.client.partitions import tune_table

        sc = self.sparse_client
        lines: list[str] = []
        p, samples, fit = tune_table(sc, name, self.num_embeddings, self.embedding_dim, alpha, steps=steps,
                                     log=lines.append)
        self.tuning = {"partitions": p, "samples": samples, "fit": fit, "alpha": alpha}
        if sc.rank == 0:
            log.info("ShardedEmbedding %r (%d x %d, alpha %g, %d workers): %s; %s; partitions: %d", name,
                     self.num_embeddings, self.embedding_dim, alpha, sc.world_size, "; ".join(lines),
                     fit if fit is not None else "too few samples for a fit, the fastest sample", p)
        return p

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self.wait()
        idx = input.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        uniq, inverse = np.unique(idx, return_inverse=True)
        rows = torch.from_numpy(self.table.pull(uniq).result(self.sparse_client.timeout + 5))
        if torch.is_grad_enabled() and self.training:
            rows.requires_grad_(True)
            self._open = uniq
            rows.register_hook(self._push)
        return F.embedding(torch.from_numpy(inverse.reshape(input.shape)).to(input.device), rows.to(input.device))

    def _push(self, grad: torch.Tensor):
        with self._lock:
            uniq, self._open = self._open, None
            if uniq is not None:
                self._pending = self.table.push(uniq, grad.detach().cpu().numpy())

    def wait(self) -> None:
        """Wait until this worker's last step is applied on the server (a
        forward without backward pushes nothing: an empty step keeps the
        workers in step)."""
        with self._lock:
            if self._open is not None:
                self._open = None
                self._pending = self.table.push(np.empty(0, np.int64), np.empty((0, self.embedding_dim), np.float32))
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result(self.sparse_client.timeout + 5)

    def weight_rows(self, indices) -> torch.Tensor:
        """The current rows at ``indices`` (read only; for evaluation and tests)."""
        self.wait()
        return torch.from_numpy(self.table.pull(np.asarray(indices)).result(self.sparse_client.timeout + 5))

    def copy_weight_(self, weight: torch.Tensor) -> None:
        """Set the table's rows from a full ``weight`` (one worker, then a
        barrier): to start from the same values as another model."""
        self.wait()
        w = weight.detach().cpu().numpy().astype(np.float32)
        self.table.write(0, w)

    def save(self, path: str) -> None:
        """Checkpoint the table and its optimizer state (one worker, between
        steps; the others may go on: no step completes without this one)."""
        self.wait()
        self.table.save(path)

    def load(self, path: str) -> None:
        """Restore a checkpoint: one worker loads, then all call
        :meth:`resume` after a barrier."""
        self.wait()
        self.table.load(path)

    def resume(self, path: str) -> None:
        """Every worker, after the load: continue the round count saved."""
        self.table.round = self.table.saved_round(path)

    def close(self) -> None:
        self.wait()
        if self._owns_client:
            self.sparse_client.close()
        else:
            self.table.close()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={self.table.name!r}, "
                f"optimizer={self.table.optimizer!r}, partitions={self.table.partitions}")
