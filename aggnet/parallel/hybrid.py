"""Training with a hybrid placement: pipeline stages from torch, each
stage's gradients all-reduced through aggnet among its copies.

Every rank builds the whole model (the same seed gives every rank the
same initial weights), keeps the layers of its stage, wraps them in DDP
over its stage's data-parallel group with the aggnet hook (the group's
own aggnet job at its rack's aggregator, :mod:`aggnet.parallel.layout`),
and runs a ``torch.distributed.pipelining`` schedule over its replica's
ranks. The loss is averaged over each micro-batch, the schedule divides
the gradients by the micro-batch count and the hook averages over the
replicas: the step is that of single-process training on the global
batch, which the tests check to 1e-5.

A stage may run on a GPU (``device=``, or wherever the model's parameters
are): its layers and its gradients stay there, the hook stages them
through pinned memory to the aggregator, and activations cross between
stages through host memory over the pipeline group's gloo. That works for
any placement, ranks sharing a GPU included (NCCL refuses two ranks on one
device), and it is what a cut between racks costs anyway: the bytes leave
the host over TCP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from aggnet.parallel.layout import Layout, LayoutError
from aggnet.parallel.profile import layers_of

SCHEDULES = ("gpipe", "1f1b")
#: the hook's options the layout decides
_HOOK_SET_HERE = frozenset({"address", "process_group", "job", "codec", "member", "alpha_threshold"})


class HybridParallel:
    """One rank's part of a hybrid run.

    ``model``: the whole ``nn.Sequential`` (built the same on every rank);
    ``stages``: each stage's (first layer, end), from
    :func:`aggnet.parallel.partition` or :func:`aggnet.parallel.plan`;
    ``sample``: one micro-batch of inputs (its shape and dtype), for the
    pipeline's buffers; ``gradients``: ``"aggnet"`` (the hook, with
    ``codec``) or ``"gloo"`` (DDP's own all-reduce on the group);
    ``address_of``: maps a stage group's :class:`~aggnet.parallel.GroupJob`
    to the address this rank reaches its aggregator at, where that is not
    the topology's (a proxy, another network's name for it); ``device``:
    where this rank's stage runs (default: where the model's parameters
    are), e.g. ``torch.device("cuda", local_rank)``; ``hook_options``:
    more of :class:`~aggnet.torch.AggnetState`'s options for the stage
    group's hook (``staging="always"`` takes CPU stages through the
    device's staging, ``check_finite``, ...).
    """

    def __init__(self, model: nn.Sequential, layout: Layout, stages, *, loss_fn, sample: torch.Tensor,
                 micro_batches: int = 1, schedule: str = "gpipe", gradients: str = "aggnet",
                 codec: str | None = None, address_of=None, device=None, hook_options: dict | None = None):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if not dist.is_initialized():
            raise RuntimeError("HybridParallel needs torch.distributed initialized over every rank of the layout "
                               "(torchrun, then dist.init_process_group('gloo'))")
        if dist.get_world_size() != layout.topology.world:
            raise LayoutError(f"the layout places {layout.topology.world} ranks but torch.distributed has "
                              f"{dist.get_world_size()}; start one process per rank of the topology")
        if len(stages) != layout.stages:
            raise LayoutError(f"{len(stages)} stage bounds for a layout of {layout.stages} stages")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if gradients not in ("aggnet", "gloo"):
            raise ValueError(f"gradients must be 'aggnet' or 'gloo', got {gradients!r}")
        if hook_options and gradients != "aggnet":
            raise ValueError(f"hook_options are the aggnet hook's, and gradients={gradients!r} uses none: leave them "
                             f"out, or give gradients='aggnet'")
        taken = sorted(set(hook_options or ()) & _HOOK_SET_HERE)
        if taken:
            raise ValueError(f"hook_options: HybridParallel sets {', '.join(taken)} itself from the layout (codec= "
                             f"and address_of= are its own arguments)")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a whole number of 1 or more, got {micro_batches!r}")
        if schedule == "1f1b" and micro_batches < layout.stages:
            raise ValueError(f"schedule '1f1b' keeps every stage busy only with at least as many micro-batches as "
                             f"stages: {micro_batches} for {layout.stages}; give micro_batches={layout.stages} or "
                             f"more, or schedule='gpipe'")
        self.layout = layout
        self.rank = dist.get_rank()
        self.stage, self.replica = layout.position(self.rank)
        self.micro_batches = micro_batches
        self.micro_batch = int(sample.shape[0])
        # rows are stages (a "dp" group each), columns replicas (a "pp"
        # group each): the groups torch's device mesh gives for this mesh
        self.mesh = DeviceMesh("cpu", torch.tensor(layout.mesh), mesh_dim_names=("pp", "dp"))
        self.dp_group = self.mesh.get_group("dp")
        self.pp_group = self.mesh.get_group("pp")
        first, end = stages[self.stage]
        layers = [layer for _, layer in layers_of(model)]
        self.device = _device_of(model, device)
        self.module = nn.Sequential(*layers[first:end]).to(self.device)
        self.job = layout.group_job(self.rank)
        if dist.get_rank(self.dp_group) != self.job.rank:
            raise LayoutError(f"rank {self.rank}: torch put it at {dist.get_rank(self.dp_group)} of its stage group, "
                              f"the layout at {self.job.rank}")
        # DDP rebuilds its buckets after the first step from the order the
        # gradients came in, and with several micro-batches per step (all
        # but the last under no_sync) it counts each parameter once per
        # micro-batch and fails; the unused-parameter search turns the
        # rebuild off and costs one walk of a stage's small graph (and, in
        # the first step only, an all-reduce of the first micro-batch's
        # gradients, which the step's sum makes no difference to)
        #
        # torch's pipeline sends and receives host tensors over the gloo
        # group; the stage moves them to its device and back, inside DDP,
        # which the pipeline's schedules must see as the stage's module
        self.ddp = DistributedDataParallel(HostBoundary(self.module, self.device, keep_output=self.is_last),
                                           process_group=self.dp_group, find_unused_parameters=micro_batches > 1)
        self.state = None
        if gradients == "aggnet":
            from aggnet.torch.hook import AggnetState, allreduce_hook

            j = self.job
            member = (j.member_rank, j.members) if j.members != j.world else None
            address = address_of(j) if address_of is not None else j.address
            self.state = AggnetState(address, process_group=self.dp_group, job=j.name, codec=codec, member=member,
                                     alpha_threshold=None, **(hook_options or {}))
            self.ddp.register_comm_hook(self.state, allreduce_hook)
        input_args = self._stage_input(layers[:first], sample)
        self.pipe_stage = PipelineStage(self.ddp, self.stage, layout.stages, torch.device("cpu"),
                                        input_args=input_args, group=self.pp_group)
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = cls(self.pipe_stage, n_microbatches=micro_batches, loss_fn=loss_fn)

    @staticmethod
    def _stage_input(before, sample: torch.Tensor):
        """A micro-batch as it reaches this stage (run through the layers
        before it once, locally, where they are): the shape the pipeline's
        host buffers take."""
        x = sample
        with torch.no_grad():
            for layer in before:
                x = layer(x.to(_device_of(layer, None, x.device)))
        return x.to("cpu")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.layout.stages - 1

    def step(self, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None) -> list:
        """Forward and backward of this replica's share of the global batch
        (``inputs`` on the first stage, ``target`` on the last; others give
        neither; on the host or the stage's device), gradients all-reduced
        in the stage group; returns the micro-batch losses on the last
        stage (on its device). The caller's optimizer over
        :attr:`module`'s parameters then steps."""
        losses: list = []
        if self.is_first and inputs is None:
            raise ValueError(f"rank {self.rank} runs the first stage: give step() this replica's inputs")
        if self.is_last and target is None:
            raise ValueError(f"rank {self.rank} runs the last stage: give step() this replica's targets")
        if self.is_first and inputs.shape[0] != self.micro_batch * self.micro_batches:
            raise ValueError(f"rank {self.rank}: step() got {inputs.shape[0]} samples; the pipeline was built for "
                             f"{self.micro_batches} micro-batch(es) of {self.micro_batch} (the sample's batch)")
        args = (inputs,) if self.is_first else ()
        # the last stage's output stays on its device, where the loss is taken
        kwargs = {"target": target.to(self.device), "losses": losses} if self.is_last else {}
        self.schedule.step(*args, **kwargs)
        return losses

    def parameters(self):
        return self.module.parameters()

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


class HostBoundary(nn.Module):
    """A stage as the pipeline sees it: host tensors in and out. Inputs go
    to ``device`` and outputs come back, unless ``keep_output`` (the last
    stage's, which the loss reads where it is); autograd moves their
    gradients the other way. On the CPU both moves are the tensors
    themselves."""

    def __init__(self, stage: nn.Module, device: torch.device, *, keep_output: bool = False):
        super().__init__()
        self.stage, self.device, self.keep_output = stage, device, keep_output

    def forward(self, *args):
        out = self.stage(*(a.to(self.device, non_blocking=True) for a in args))
        return out if self.keep_output else out.to("cpu")


def _device_of(module: nn.Module, device, default=torch.device("cpu")) -> torch.device:
    """``device`` if given, else where ``module``'s parameters are (one
    device: a stage spread over several is not a stage this runs)."""
    if device is not None:
        return torch.device(device)
    found = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
    if len(found) > 1:
        raise ValueError(f"the model's parameters are on {sorted(map(str, found))}; move it to one device, or give "
                         f"device= for this rank's stage")
    return found.pop() if found else torch.device(default)
