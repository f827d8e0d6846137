"""The switch program's sources, generated definitions and compiled
artifacts stay in step with aggnet/wire.py and with each other."""

from __future__ import annotations

import re

import pytest

from aggnet import wire
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
