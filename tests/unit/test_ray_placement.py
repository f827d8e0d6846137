"""Where aggnet.ray puts a topology's aggregators and which topology the Ray
Train workers read: the parts that need no Ray cluster (the cluster run is
tests/integration/test_ray.py)."""

import pathlib

import pytest

from aggnet.protocol.topology import TopologyError, load, loads
from aggnet.ray.placement import RACK_LABEL, ROOT_LABEL, missing_labels, on_node, roles, worker_topology

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples/topologies"

RACKS = """
job = "placed"
[root]
kind = "service"
address = "zmq+tcp://10.0.0.1:6000"
shards = 2
[[racks]]
name = "rack0"
ranks = "0-1"
[racks.aggregator]
kind = "service"
address = "zmq+tcp://10.0.1.1:6100"
shards = 2
[[racks]]
name = "rack1"
ranks = "2-3"
[racks.aggregator]
kind = "service"
address = "zmq+tcp://10.0.2.1:6200"
shards = 2
"""

ADDRESSES = {"root": "zmq+tcp://192.0.2.9:6000", "rack rack0": "zmq+tcp://192.0.2.10:6100",
             "rack rack1": "zmq+tcp://192.0.2.11:6200"}


def test_the_root_starts_first_and_each_aggregator_selects_its_label():
    got = [(r.name, r.selector) for r in roles(loads(RACKS))]
    assert got == [("root", {ROOT_LABEL: "true"}), ("rack rack0", {RACK_LABEL: "rack0"}),
                   ("rack rack1", {RACK_LABEL: "rack1"})]


def test_an_aggregator_listens_at_its_port_on_the_node_ip():
    assert on_node("zmq+tcp://10.0.1.1:6100", "192.0.2.10") == "zmq+tcp://192.0.2.10:6100"
    assert on_node("udp://0.0.0.0:42606", "192.0.2.10") == "udp://192.0.2.10:42606"
    assert on_node("ucx://[::1]:13337", "fd00::5") == "ucx://[fd00::5]:13337"


def test_the_workers_racks_are_where_ray_placed_them_not_the_file_ranks():
    # Ray put ranks 0 and 2 on rack1's nodes, 1 and 3 on rack0's
    topo = loads(worker_topology(loads(RACKS), ADDRESSES, ["rack1", "rack0", "rack1", "rack0"]))
    assert [(r.name, r.ranks, r.aggregator.address, r.aggregator.shards) for r in topo.racks] == [
        ("rack0", (1, 3), "zmq+tcp://192.0.2.10:6100", 2), ("rack1", (0, 2), "zmq+tcp://192.0.2.11:6200", 2)]
    assert topo.root.address == "zmq+tcp://192.0.2.9:6000" and topo.job == "placed"
    assert topo.place(2).address == "zmq+tcp://192.0.2.11:6200"


@pytest.mark.parametrize("racks, says", [
    (["rack0", None, "rack1", "rack1"], f"worker 1 on a node without the {RACK_LABEL} label"),
    (["rack0", "rack2", "rack1", "rack1"], "rack 'rack2', which"),
    (["rack0", "rack0", "rack0"], "rack 'rack1' has no training worker"),
])
def test_workers_the_topology_cannot_place_fail_with_the_fix(racks, says):
    with pytest.raises(TopologyError, match=says):
        worker_topology(loads(RACKS), ADDRESSES, racks)


def test_a_rack_label_no_node_carries_is_named_as_a_ray_start_argument():
    nodes = [{ROOT_LABEL: "true"}, {RACK_LABEL: "rack1", "other": "x"}]
    assert missing_labels(roles(loads(RACKS)), nodes) == [f"{RACK_LABEL}=rack0"]
    assert missing_labels(roles(loads(RACKS)), nodes + [{RACK_LABEL: "rack0"}]) == []


def test_a_p4_switch_or_a_local_only_address_is_refused_as_an_actor():
    p4 = load(EXAMPLES / "p4-racks.toml")
    with pytest.raises(TopologyError, match="P4 switch, which is not a Ray actor"):
        roles(p4)
    ipc = 'job = "x"\n[[racks]]\nname = "r"\nranks = "0"\n[racks.aggregator]\nkind = "service"\n' \
          'address = "zmq+ipc:///tmp/agg"\n'
    with pytest.raises(TopologyError, match="only its own machine reaches"):
        roles(loads(ipc))
