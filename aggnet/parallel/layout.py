"""Which rank runs which stage of which model replica, from a topology.

A hybrid run cuts the model into K stages and keeps D replicas of the
pipeline; ``mesh[k][d]`` is the global rank that runs stage k of replica
d. The ranks of one column form a pipeline (activations flow between
them); the ranks of one row hold copies of one stage and all-reduce its
gradients (a data-parallel group, an aggnet job of its own). Two
placements, by what they keep off the uplinks:

* ``"stage-per-rack"`` (the UNIST paper's): rack k holds stage k of every
  replica, so each stage's data-parallel group lives inside one rack and
  its aggnet job completes at that rack's aggregator: no gradient byte
  crosses racks; only activations (and their gradients) do, once per cut.
  Needs as many racks as stages, all of the same size.
* ``"pipeline-in-rack"``: each replica's K stages sit on K consecutive
  ranks of one rack (on one host where ``procs_per_host`` allows), so
  activations never leave the rack; each stage's gradients are reduced
  through the racks' aggregators and the root, one partial per rack.
  Needs every rack's size to be a multiple of K.

Ranks are numbered as the topology numbers them (rack by rack, host by
host: torchrun's order), so the mesh is the one ``init_device_mesh`` would
build for ``("pp", "dp")`` in the first placement and ``("dp", "pp")`` in
the second.
"""

from __future__ import annotations

from dataclasses import dataclass

from aggnet.protocol import topology as topo

PLACEMENTS = ("stage-per-rack", "pipeline-in-rack")


class LayoutError(ValueError):
    """A placement the topology cannot hold; the message says what would."""


@dataclass(frozen=True)
class GroupJob:
    """How one rank joins its stage's data-parallel aggnet job."""

    name: str
    #: global ranks of the group, in group order (replica order)
    ranks: tuple
    #: the aggregator this rank joins: its rack's
    address: str
    rank: int  #: this rank's place in the group
    world: int  #: the group's size
    member_rank: int  #: this rank's place among the group's ranks in its rack
    members: int  #: the group's ranks in this rank's rack
    #: whether the group's gradients cross racks (through the root)
    crosses_racks: bool

    def client_kwargs(self) -> dict:
        """Arguments of :class:`aggnet.Client` for this rank."""
        kw = {"job": self.name, "rank": self.rank, "world_size": self.world}
        if self.members != self.world:
            kw.update(member_rank=self.member_rank, members=self.members)
        return kw


@dataclass(frozen=True)
class Layout:
    """The stages and replicas of a hybrid run over a topology."""

    placement: str
    topology: topo.Topology
    #: mesh[stage][replica] = global rank
    mesh: tuple
    job: str

    @property
    def stages(self) -> int:
        return len(self.mesh)

    @property
    def replicas(self) -> int:
        return len(self.mesh[0])

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``."""
        for k, row in enumerate(self.mesh):
            if rank in row:
                return k, row.index(rank)
        raise LayoutError(f"rank {rank!r} is not in this layout of ranks 0..{self.topology.world - 1}")

    def pipeline_ranks(self, replica: int) -> tuple:
        """The ranks of one replica's stages, first stage first."""
        return tuple(row[replica] for row in self.mesh)

    def stage_ranks(self, stage: int) -> tuple:
        """The ranks holding copies of one stage (its data-parallel group)."""
        return tuple(self.mesh[stage])

    def group_job(self, rank: int) -> GroupJob:
        """The data-parallel aggnet job ``rank`` joins for its stage."""
        stage, replica = self.position(rank)
        ranks = self.stage_ranks(stage)
        rack = self.topology.place(rank).rack
        here = [r for r in ranks if r in rack.ranks]
        racks = {self.topology.place(r).rack.index for r in ranks}
        return GroupJob(f"{self.job}-stage{stage}", ranks, _host_aggregator(rack).address, replica, len(ranks),
                        here.index(rank), len(here), len(racks) > 1)

    def uplink_racks(self) -> int:
        """Racks a stage's gradients come from (1: none cross racks)."""
        return max(len({self.topology.place(r).rack.index for r in row}) for row in self.mesh)

    def describe(self) -> list[str]:
        """One line per stage: its ranks and where its gradients go."""
        lines = []
        for k, row in enumerate(self.mesh):
            racks = sorted({self.topology.place(r).rack.name for r in row})
            where = (f"aggregated in {racks[0]}, nothing to the root" if len(racks) == 1 else
                     f"aggregated in {', '.join(racks)} and across them at the root")
            lines.append(f"stage {k}: ranks {list(row)}; gradients {where}")
        return lines


def build(topology, stages: int, placement: str = "stage-per-rack", job: str | None = None) -> Layout:
    """The mesh of ``placement`` over ``topology`` (a path, TOML text or a
    loaded one) for ``stages`` pipeline stages."""
    t = topo.load(topology)
    if placement not in PLACEMENTS:
        raise LayoutError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if not isinstance(stages, int) or stages < 1:
        raise LayoutError(f"stages must be a whole number of 1 or more, got {stages!r}")
    sizes = [r.members for r in t.racks]
    if placement == "stage-per-rack":
        if len(t.racks) != stages:
            raise LayoutError(f"{t.source}: placement 'stage-per-rack' puts stage k in rack k, so it needs as many "
                              f"racks as stages: {len(t.racks)} rack(s), {stages} stage(s); use --stages "
                              f"{len(t.racks)} or placement 'pipeline-in-rack'")
        if len(set(sizes)) != 1:
            raise LayoutError(f"{t.source}: placement 'stage-per-rack' needs racks of one size (each rack holds one "
                              f"stage of every replica); rack sizes are {sizes}")
        mesh = tuple(tuple(r.ranks) for r in t.racks)
    else:
        bad = [f"{r.name} ({r.members})" for r in t.racks if r.members % stages]
        if bad:
            raise LayoutError(f"{t.source}: placement 'pipeline-in-rack' keeps each replica's {stages} stages in "
                              f"one rack, so every rack's size must be a multiple of {stages}; not: "
                              f"{', '.join(bad)}")
        columns = [tuple(r.ranks[i:i + stages]) for r in t.racks for i in range(0, r.members, stages)]
        mesh = tuple(tuple(col[k] for col in columns) for k in range(stages))
    for r in t.racks:
        _host_aggregator(r)
    return Layout(placement, t, mesh, job or t.job)


def _host_aggregator(rack: topo.Rack) -> topo.Aggregator:
    """The aggregator a stage group joins in ``rack``: a P4 switch's jobs
    are installed by its control plane for whole racks, so groups use
    the rack's host fallback."""
    if rack.aggregator.kind != "p4":
        return rack.aggregator
    if rack.fallback is not None:
        return rack.fallback
    raise LayoutError(f"{rack.aggregator.where}: rack {rack.name!r} is aggregated by a P4 switch, whose jobs cover "
                      f"whole racks; give the rack a [racks.fallback] host aggregator for stage groups")
