"""Stages and their copies placed on a topology's racks: the mesh each
placement builds, the aggnet job each stage group joins, and the
placements a topology cannot hold, each refused with what would work."""

import numpy as np
import pytest

from aggnet.parallel import LayoutError, build_layout


def _racks(sizes, kind="service", fallback=False):
    lines, first = ['job = "hyb"', "[root]", 'kind = "service"', 'address = "zmq+tcp://127.0.0.1:47000"',
                    "shards = 1"], 0
    if kind == "p4":
        lines[2:5] = ['kind = "host-switch"', 'address = "udp://127.0.0.9:42606"']
    for i, n in enumerate(sizes):
        lines += ["[[racks]]", f'name = "rack{i}"', f'ranks = "{first}-{first + n - 1}"']
        if kind == "p4":
            lines.append(f'aggregator = {{ kind = "p4", address = "udp://127.0.{i}.1:42606", '
                         f'p4runtime = "127.0.0.1:1" }}')
            if fallback:
                lines.append(f'fallback = {{ kind = "host-switch", address = "udp://127.0.0.1:{47200 + i}" }}')
        else:
            lines.append(f'aggregator = {{ kind = "service", address = "zmq+tcp://127.0.0.1:{47010 + 10 * i}", shards = 1 }}')
        first += n
    return "\n".join(lines) + "\n"


def test_stage_per_rack_keeps_each_stage_group_in_its_rack():
    layout = build_layout(_racks([4, 4]), 2, "stage-per-rack")
    # torch's init_device_mesh(("pp", "dp")) lays ranks out row-major
    assert np.array_equal(np.array(layout.mesh), np.arange(8).reshape(2, 4))
    assert layout.pipeline_ranks(1) == (1, 5)
    job = layout.group_job(6)
    assert (job.name, job.ranks, job.rank, job.world, job.members) == ("hyb-stage1", (4, 5, 6, 7), 2, 4, 4)
    assert job.address == "zmq+tcp://127.0.0.1:47020" and not job.crosses_racks
    assert job.client_kwargs() == {"job": "hyb-stage1", "rank": 2, "world_size": 4}
    assert layout.uplink_racks() == 1


def test_pipeline_in_rack_spreads_each_stage_group_over_the_racks():
    layout = build_layout(_racks([4, 4]), 2, "pipeline-in-rack")
    # init_device_mesh(("dp", "pp")): a replica's stages on consecutive ranks
    assert np.array_equal(np.array(layout.mesh), np.arange(8).reshape(4, 2).T)
    job = layout.group_job(5)  # stage 1 of replica 2, the first replica of rack1
    assert (job.rank, job.world, job.member_rank, job.members, job.crosses_racks) == (2, 4, 0, 2, True)
    assert job.client_kwargs() == {"job": "hyb-stage1", "rank": 2, "world_size": 4, "member_rank": 0, "members": 2}
    assert "across them at the root" in layout.describe()[0]


@pytest.mark.parametrize("sizes, stages, placement, says", [
    ([4, 4], 3, "stage-per-rack", "needs as many racks as stages"),
    ([4, 2], 2, "stage-per-rack", "racks of one size"),
    ([4, 3], 2, "pipeline-in-rack", "multiple of 2; not: rack1 (3)"),
    ([4, 4], 0, "stage-per-rack", "1 or more"),
    ([4, 4], 2, "ring", "placement must be one of"),
])
def test_placements_a_topology_cannot_hold_say_what_would(sizes, stages, placement, says):
    with pytest.raises(LayoutError, match=says.replace("(", r"\(").replace(")", r"\)")):
        build_layout(_racks(sizes), stages, placement)


def test_a_p4_rack_puts_stage_groups_on_its_fallback_or_says_to_add_one():
    layout = build_layout(_racks([2, 2], "p4", fallback=True), 2, "stage-per-rack")
    assert layout.group_job(3).address == "udp://127.0.0.1:47201"
    with pytest.raises(LayoutError, match="give the rack a \\[racks.fallback\\]"):
        build_layout(_racks([2, 2], "p4"), 2, "stage-per-rack")
