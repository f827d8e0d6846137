"""Topology files: every kind of mistake fails the load naming its line and
the fix; the examples load; ranks are placed rack by rack."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from aggnet.protocol import topology
from aggnet.protocol.topology import TopologyError

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "topologies"


def _file(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "x.toml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def _fails(tmp_path, text: str) -> str:
    """The message of loading ``text`` from a file named x.toml."""
    path = _file(tmp_path, text)
    with pytest.raises(TopologyError) as err:
        topology.load(path)
    return str(err.value)


def _at(tmp_path, message: str, line: int | None) -> None:
    prefix = f"{tmp_path / 'x.toml'}:{line}: " if line else f"{tmp_path / 'x.toml'}: "
    assert message.startswith(prefix), message


SWITCH_RACKS = """
[root]
kind = "host-switch"
address = "udp://127.0.0.1:40000"

[[racks]]
name = "rack0"
{first}
[racks.aggregator]
kind = "host-switch"
address = "udp://127.0.0.1:40001"

[[racks]]
name = "rack1"
{second}
[racks.aggregator]
kind = "host-switch"
address = "udp://127.0.0.1:40002"
"""

SERVICE_RACKS = """
[root]
kind = "service"
address = "zmq+tcp://127.0.0.1:40000"
shards = {root_shards}

[[racks]]
ranks = "0-1"
[racks.aggregator]
kind = "service"
address = "zmq+tcp://127.0.0.1:40001"
shards = 2

[[racks]]
ranks = "2-3"
[racks.aggregator]
kind = "service"
address = "zmq+tcp://127.0.0.1:40002"
shards = 2
"""


# -- racks and their workers ------------------------------------------------------------


def test_a_misspelt_rack_key_names_its_line_and_the_keys_allowed(tmp_path):
    msg = _fails(tmp_path, SWITCH_RACKS.format(first='rank = "0-1"', second='ranks = "2-3"'))
    _at(tmp_path, msg, 7)
    assert "unknown key 'rank'" in msg
    assert "allowed: aggregator, fallback, hosts, name, ranks" in msg


def test_a_host_in_two_racks_is_refused(tmp_path):
    msg = _fails(tmp_path, SWITCH_RACKS.format(first='hosts = ["a", "b"]', second='hosts = ["c", "a"]'))
    _at(tmp_path, msg, 14)
    assert "host 'a' is in rack 'rack0' and in rack 'rack1'" in msg
    assert "a worker belongs to one rack" in msg


def test_a_rank_in_two_racks_is_refused(tmp_path):
    msg = _fails(tmp_path, SWITCH_RACKS.format(first='ranks = "0-1"', second='ranks = "1-2"'))
    _at(tmp_path, msg, 14)
    assert "rank 1 is in rack 'rack0' and in rack 'rack1'" in msg


def test_ranks_with_a_gap_name_the_missing_ones(tmp_path):
    msg = _fails(tmp_path, SWITCH_RACKS.format(first='ranks = "0-1"', second='ranks = "3-4"'))
    assert "ranks must run from 0 to 3" in msg
    assert "none holds 2" in msg and "the racks hold 0-1,3-4" in msg


def test_hosts_in_one_rack_and_ranks_in_another_are_refused(tmp_path):
    msg = _fails(tmp_path, SWITCH_RACKS.format(first='hosts = ["a", "b"]', second='ranks = "2-3"'))
    _at(tmp_path, msg, 12)
    assert "use one form for every rack" in msg


def test_a_rack_of_more_than_32_workers_says_to_split_it(tmp_path):
    msg = _fails(tmp_path, SWITCH_RACKS.format(first='ranks = "0-32"', second='ranks = "33-34"'))
    assert "at most 32 per rack: split it into racks" in msg


# -- what aggregates them -----------------------------------------------------------------


def test_service_racks_under_a_host_switch_root_are_refused(tmp_path):
    text = SWITCH_RACKS.format(first='ranks = "0-1"', second='ranks = "2-3"')
    text = text.replace('kind = "host-switch"\naddress = "udp://127.0.0.1:40001"',
                        'kind = "service"\naddress = "zmq+tcp://127.0.0.1:40001"')
    msg = _fails(tmp_path, text)
    _at(tmp_path, msg, 9)  # the rack's kind
    assert "rack 'rack0' is aggregated by a service" in msg and "the root is a host-switch" in msg
    assert 'make the root kind = "service" or change the rack\'s' in msg


def test_switch_racks_under_a_service_root_are_refused(tmp_path):
    text = SWITCH_RACKS.format(first='ranks = "0-1"', second='ranks = "2-3"')
    text = text.replace('kind = "host-switch"\naddress = "udp://127.0.0.1:40000"',
                        'kind = "service"\naddress = "zmq+tcp://127.0.0.1:40000"\nshards = 1')
    msg = _fails(tmp_path, text)
    _at(tmp_path, msg, 10)
    assert "is aggregated by a host-switch" in msg and "the root is a service" in msg
    assert 'make the root kind = "host-switch"' in msg


def test_a_service_at_a_udp_address_is_refused(tmp_path):
    msg = _fails(tmp_path, """
        [[racks]]
        ranks = "0-1"
        [racks.aggregator]
        kind = "service"
        address = "udp://127.0.0.1:40001"
    """)
    _at(tmp_path, msg, 5)
    assert "a service aggregator is reached at tcp:// or zmq+tcp://" in msg and "not 'udp://127.0.0.1:40001'" in msg


def test_a_host_switch_at_a_zmq_address_is_refused(tmp_path):
    msg = _fails(tmp_path, """
        [[racks]]
        ranks = "0-1"
        [racks.aggregator]
        kind = "host-switch"
        address = "zmq+tcp://127.0.0.1:40001"
    """)
    _at(tmp_path, msg, 5)
    assert "a host-switch aggregator is reached at udp://" in msg


def test_an_unknown_kind_lists_the_kinds(tmp_path):
    msg = _fails(tmp_path, """
        [[racks]]
        ranks = "0-1"
        [racks.aggregator]
        kind = "tofino"
        address = "udp://127.0.0.1:40001"
    """)
    _at(tmp_path, msg, 4)
    assert "kind must be one of p4, host-switch, service, got 'tofino'" in msg


def test_a_p4_switch_without_p4runtime_says_how_to_give_it(tmp_path):
    msg = _fails(tmp_path, """
        [[racks]]
        ranks = "0-1"
        [racks.aggregator]
        kind = "p4"
        address = "udp://10.0.1.253:42606"
        ports = [1, 2]
    """)
    _at(tmp_path, msg, 3)  # the table the key is missing from
    assert 'needs p4runtime = "host:port"' in msg


def test_p4_settings_on_a_host_are_refused(tmp_path):
    msg = _fails(tmp_path, """
        [[racks]]
        ranks = "0-1"
        [racks.aggregator]
        kind = "host-switch"
        address = "udp://127.0.0.1:40001"
        p4runtime = "127.0.0.1:9559"
    """)
    _at(tmp_path, msg, 6)
    assert "p4runtime belong to P4 switches" in msg


def test_a_switch_listing_other_ports_than_workers_is_refused(tmp_path):
    msg = _fails(tmp_path, """
        [[racks]]
        ranks = "0-1"
        [racks.aggregator]
        kind = "p4"
        address = "udp://10.0.1.253:42606"
        p4runtime = "10.0.1.253:9559"
        ports = [1, 2, 3]
    """)
    _at(tmp_path, msg, 7)
    assert "lists 3 ports for 2 workers; give one port per worker" in msg


def test_a_fallback_on_a_rack_without_a_switch_is_refused(tmp_path):
    msg = _fails(tmp_path, """
        [[racks]]
        ranks = "0-1"
        [racks.aggregator]
        kind = "host-switch"
        address = "udp://127.0.0.1:40001"
        [racks.fallback]
        kind = "host-switch"
        address = "udp://127.0.0.1:40002"
    """)
    _at(tmp_path, msg, 7)
    assert "a fallback stands in for a P4 switch" in msg
    assert "this rack's aggregator is 'host-switch'" in msg


def test_racks_without_a_root_are_refused(tmp_path):
    text = SWITCH_RACKS.format(first='ranks = "0-1"', second='ranks = "2-3"').split("\n", 4)[4]
    msg = _fails(tmp_path, text)
    assert "2 racks need a [root] that reduces across them" in msg
    assert 'kind = "host-switch" for switch-protocol racks' in msg


def test_a_service_root_with_other_shards_than_its_racks_is_refused(tmp_path):
    msg = _fails(tmp_path, SERVICE_RACKS.format(root_shards=4))
    _at(tmp_path, msg, 4)
    assert "must have the same number of shards" in msg
    assert "the root 4, rack 'rack0' 2, rack 'rack1' 2" in msg


def test_a_service_root_and_racks_with_shards_unset_are_refused(tmp_path):
    # one per core would differ between machines of other sizes
    text = SERVICE_RACKS.format(root_shards=2).replace("shards = 2\n", "")
    msg = _fails(tmp_path, text)
    assert "unset (one per core of its machine)" in msg
    assert "set shards = N, the same N, on the root and every rack" in msg


def test_a_service_root_and_racks_with_equal_shards_load(tmp_path):
    topo = topology.load(_file(tmp_path, SERVICE_RACKS.format(root_shards=2)))
    assert topo.root.shards == 2 and topo.world == 4


def test_two_aggregators_on_one_port_are_refused(tmp_path):
    text = SWITCH_RACKS.format(first='ranks = "0-1"', second='ranks = "2-3"').replace("40002", "40001")
    msg = _fails(tmp_path, text)
    _at(tmp_path, msg, 17)
    assert "the aggregator of rack 'rack1'" in msg and f"rack 'rack0' ({tmp_path / 'x.toml'}:10)" in msg
    assert "both need port 40001" in msg


def test_a_sharded_host_switch_takes_a_port_per_shard(tmp_path):
    text = SWITCH_RACKS.format(first='ranks = "0-1"', second='ranks = "2-3"')
    text = text.replace('address = "udp://127.0.0.1:40000"', 'address = "udp://127.0.0.1:40000"\nshards = 2')
    msg = _fails(tmp_path, text)
    assert "both need port 40001" in msg and "shards = N listens on N ports" in msg


# -- the file itself ---------------------------------------------------------------------


def test_bad_toml_names_the_file_and_where_it_broke(tmp_path):
    msg = _fails(tmp_path, 'job = "x"\n[[racks]\nname = "r"\n')
    _at(tmp_path, msg, None)
    assert "not valid TOML" in msg and "line 2" in msg


def test_a_missing_file_says_what_to_give(tmp_path):
    with pytest.raises(TopologyError) as err:
        topology.load(tmp_path / "absent.toml")
    msg = str(err.value)
    assert f"cannot read topology file {tmp_path / 'absent.toml'}: No such file or directory" in msg
    assert "examples/topologies/" in msg


def test_loads_names_the_text_it_was_given():
    with pytest.raises(TopologyError, match=r"^inline:1: unknown key 'jobs' in the topology"):
        topology.loads('jobs = "x"\n', "inline")


# -- the examples and placement --------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_loads(path):
    topo = topology.load(path)
    assert topo.source == str(path)
    assert topo.world == sum(r.members for r in topo.racks) > 0
    placed = [topo.place(rank) for rank in range(topo.world)]
    assert sorted(p.rank for p in placed) == list(range(topo.world))
    for role, rack, agg in topo.aggregators():
        if agg.kind != "p4":
            argv = agg.serve_argv(topo.parent_of(rack) if rack is not None else None,
                                  rack.index if rack is not None else 0, len(topo.racks))
            assert argv[:3] == ["serve", "--listen", agg.address]


def test_two_racks_places_ranks_host_by_host():
    topo = topology.load(EXAMPLES / "two-racks.toml")
    assert topo.job == "two-racks" and topo.world == 8
    assert topo.links.host_mbit == 400 and topo.links.uplink_mbit == 100
    for rank in range(8):
        p = topo.place(rank)
        rack = rank // 4
        assert p.rack.name == f"rack{rack}"
        assert p.member_rank == rank % 4
        assert p.members == 4 and p.world == 8
        assert p.address == f"udp://10.77.{rack + 1}.254:42606"
        assert p.rack.hosts[p.member_rank] == f"r{rack}w{rank % 4}"
        assert p.parent is topo.root and p.parent.address == "udp://10.77.0.1:42606"
    assert topo.host_ranks("r1w2") == [6]


def test_one_machine_places_ranks_by_their_ranges():
    topo = topology.load(EXAMPLES / "one-machine.toml")
    assert topo.world == 4
    want = {0: ("rack0", 0, 42701), 1: ("rack0", 1, 42701), 2: ("rack1", 0, 42702), 3: ("rack1", 1, 42702)}
    for rank, (name, member, port) in want.items():
        p = topo.place(rank)
        assert (p.rack.name, p.member_rank, p.members) == (name, member, 2)
        assert p.address == f"udp://127.0.0.1:{port}"
        assert p.parent.address == "udp://127.0.0.1:42700"


def test_procs_per_host_numbers_ranks_within_each_host(tmp_path):
    text = 'procs_per_host = 2\n' + SWITCH_RACKS.format(first='hosts = ["a", "b"]', second='hosts = ["c"]')
    topo = topology.load(_file(tmp_path, text))
    assert topo.world == 6
    assert [(topo.place(r).rack.name, topo.place(r).member_rank) for r in range(6)] == [
        ("rack0", 0), ("rack0", 1), ("rack0", 2), ("rack0", 3), ("rack1", 0), ("rack1", 1)]
    assert topo.host_ranks("b") == [2, 3]


def test_one_rack_has_no_parent(tmp_path):
    topo = topology.load(_file(tmp_path, """
        [[racks]]
        ranks = "0-2"
        [racks.aggregator]
        kind = "host-switch"
        address = "udp://127.0.0.1:40001"
    """))
    assert topo.place(2).parent is None and topo.place(2).members == 3
    assert [role for role, _, _ in topo.aggregators()] == ["rack"]


def test_a_rank_outside_the_topology_says_which_ranks_it_holds():
    topo = topology.load(EXAMPLES / "one-machine.toml")
    with pytest.raises(TopologyError, match=r"rank 4 is not in this topology, whose 2 rack\(s\) hold ranks 0\.\.3"):
        topo.place(4)


P4_RACK = """
[root]
kind = "host-switch"
address = "udp://10.0.0.1:{root_port}"

[[racks]]
ranks = "0-1"
[racks.aggregator]
kind = "p4"
address = "udp://10.0.1.253:{port}"
p4runtime = "10.0.1.253:9559"

[[racks]]
ranks = "2-3"
[racks.aggregator]
kind = "host-switch"
address = "udp://10.0.2.254:42606"
"""


def test_a_p4_switch_on_another_port_than_its_program_is_refused(tmp_path):
    msg = _fails(tmp_path, P4_RACK.format(root_port=42606, port=5000))
    _at(tmp_path, msg, 9)
    assert "a P4 switch takes the switch protocol on UDP port 42606 only" in msg
    assert "make its address udp://10.0.1.253:42606" in msg


def test_a_root_above_a_p4_switch_on_another_port_is_refused(tmp_path):
    msg = _fails(tmp_path, P4_RACK.format(root_port=5000, port=42606))
    _at(tmp_path, msg, 3)
    assert "sends the rack's partial sums to UDP port 42606 of the root" in msg
