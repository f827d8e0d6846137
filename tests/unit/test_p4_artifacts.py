"""The switch program's sources, generated definitions and compiled
artifacts stay in step with aggnet/protocol/wire.py and with each other."""

from __future__ import annotations

import re

import pytest

from aggnet.protocol import limits, messages, wire
from aggnet.p4 import compile as p4compile
from aggnet.p4 import control, generate


def test_generated_p4_matches_wire_py():
    assert generate.main(["--check"]) == 0, "run: python -m aggnet.p4.generate"


def test_p4_header_is_the_wire_header():
    text = (generate.SOURCES / "wire.p4").read_text()
    body = re.search(r"header aggnet_h \{(.*?)\}", text, re.S).group(1)
    fields = re.findall(r"(bit<(\d+)>|msg_type_t) (\w+);", body)
    assert [(name, 8 if t == "msg_type_t" else int(bits)) for t, bits, name in fields] == list(wire.HEADER_FIELDS)
    assert f"0x{wire.MAGIC:04X}" in text


def test_compiled_artifacts_were_built_from_these_sources():
    recorded = p4compile.recorded_digest()
    assert recorded is not None, "p4/build/SOURCES is missing: run python -m aggnet.p4.compile"
    assert recorded == p4compile.sources_digest(), (
        "the P4 sources changed after p4/build was compiled: run python -m aggnet.p4.compile and commit p4/build")
    assert p4compile.BMV2_JSON.stat().st_size > 0 and p4compile.P4INFO.stat().st_size > 0


def test_control_plane_names_exist_in_the_p4info():
    p4info = p4compile.P4INFO.read_text()
    names = set(re.findall(r'name: "([^"]+)"', p4info))
    wanted = {control.P + n for n in ("jobs", "admission", "job", "admit", "drops", "events", "completions")}
    wanted |= {control.P + r for r in control._SLOT_REGISTERS}
    wanted |= {"AggEgress.replicas", "AggEgress.to_member", "AggIngress.forward.l2", "AggIngress.forward.to_port"}
    assert wanted <= names, sorted(wanted - names)


@pytest.mark.skipif(p4compile.find_p4c() is None, reason="p4c is not installed; the digest test above still guards the artifacts")
def test_recompiling_reproduces_the_committed_artifacts(tmp_path):
    json_path, p4info = p4compile.compile_to(tmp_path, p4compile.find_p4c())
    assert json_path.read_bytes() == p4compile.BMV2_JSON.read_bytes()
    assert p4info.read_bytes() == p4compile.P4INFO.read_bytes()


def _p4_consts(path) -> dict:
    return {name: int(value, 0) for name, value in
            re.findall(r"const bit<\d+> (\w+) = (0x[0-9A-Fa-f]+|\d+);", path.read_text())}


def test_p4_limits_and_counter_indices_are_limits_py():
    consts = _p4_consts(generate.SOURCES / "limits.p4")
    assert {n: consts[f"DROP_{n}"] for n in limits.Drop.__members__} == {d.name: int(d) for d in limits.Drop}
    assert {n: consts[f"EV_{n}"] for n in limits.Event.__members__} == {e.name: int(e) for e in limits.Event}
    assert consts["AGG_DROP_REASONS"] == len(limits.Drop) and consts["AGG_EVENTS"] == len(limits.Event)
    assert (consts["AGG_POOL"], consts["AGG_MAX_JOBS"], consts["AGG_MAX_WORKERS"], consts["FLOOD_GROUP"]) == \
        (limits.P4_POOL, limits.MAX_JOBS, limits.MAX_WORKERS, limits.FLOOD_GROUP)
    # a job's multicast group is its row + 1: the flood group lies above them all
    assert limits.FLOOD_GROUP > limits.MAX_JOBS
    assert control.DROP_REASONS[limits.Drop.TYPE] == "type" and control.EVENTS[limits.Event.JOINS] == "joins"


def test_hand_written_p4_defines_no_generated_constant():
    generated = set()
    for name in generate.outputs():
        generated |= set(_p4_consts(name))
    for path in generate.SOURCES.glob("*.p4"):
        if path in generate.outputs():
            continue
        copies = generated & set(_p4_consts(path))
        assert not copies, f"{path.name} defines {sorted(copies)}, which are generated from aggnet/protocol"


def test_the_p4_answers_are_written_by_the_generated_actions():
    text = (generate.SOURCES / "aggregate.p4").read_text()
    for view in messages.P4_ANSWERS:
        assert f"answer_{view.MSG_TYPE.name.lower()}(" in text
        assert f"msg_type_t.{view.MSG_TYPE.name};" not in text, f"aggregate.p4 writes {view.MSG_TYPE.name} by hand"


@pytest.mark.skipif(p4compile.find_p4c() is None, reason="p4c is not installed; the digest test above still guards the artifacts")
def test_a_compile_that_changes_nothing_writes_nothing(capsys):
    """A clean tree stays clean: the artifacts and their record are not
    rewritten when the compiler builds them byte for byte again (another
    build of it may print another version string)."""
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (p4compile.BMV2_JSON, p4compile.P4INFO,
                                                                    p4compile.DIGEST)}
    assert p4compile.main([]) == 0
    assert "is up to date" in capsys.readouterr().out
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in before} == before
