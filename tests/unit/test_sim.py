"""The simulator's model against what can be derived or counted without
it: a ring's 2(N-1)/N, the ring edges that leave a rack under random
placement (counted over random placements), the switch protocol's
window and loss, the pool's fallback; and the command at 16,384 workers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from aggnet.sim import hardware, model

MiB = 1 << 20
HW = hardware.load("tofino-100g")


def test_a_ring_moves_2_n_minus_1_over_n_and_takes_a_step_latency_per_step():
    shape = model.Shape(4, 8)
    p = model.predict("ring", HW, shape, 64 * MiB)
    wire = 2 * 31 / 32 * 64 * MiB / (HW.tcp_efficiency() * HW.host_rate)
    assert p.terms["host link"] == pytest.approx(wire)
    assert p.terms["latency"] == pytest.approx(2 * 31 * HW.step_latency)
    assert p.seconds == pytest.approx(max(p.terms["host link"], p.terms["uplink"]) + p.terms["latency"])


def test_random_placement_crossings_match_a_count_over_random_rings():
    shape = model.Shape(4, 5)
    rng = np.random.default_rng(0)
    counts = []
    for _ in range(4000):
        order = rng.permutation(shape.workers)
        rack = order // shape.workers_per_rack  # rack of each position in the ring
        counts.append(np.sum((rack == 0) & (np.roll(rack, -1) != 0)))
    assert np.mean(counts) == pytest.approx(model.ring_crossings(shape, rack_aware=False), rel=0.03)
    assert model.ring_crossings(shape, rack_aware=True) == 1
    assert model.ring_crossings(model.Shape(1, 8), rack_aware=False) == 0


def test_the_switch_sends_s_once_whatever_the_worker_count_and_the_ring_does_not():
    ours = [model.predict("aggnet-switch", HW, model.Shape(n // 32, 32), 100 * MiB).seconds for n in (1024, 16384)]
    ring = [model.predict("ring", HW, model.Shape(n // 32, 32), 100 * MiB).seconds for n in (1024, 16384)]
    assert ours[0] == pytest.approx(ours[1])
    assert ring[1] > 5 * ring[0]  # 2(N-1) step latencies
    # without step latency the ring is 2 (N-1)/N S over its link, the switch S over its own
    flat = HW.replace(step_latency=0.0)
    r = model.predict("ring", flat, model.Shape(512, 32), 100 * MiB).seconds
    s = model.predict("aggnet-switch", flat, model.Shape(512, 32), 100 * MiB).seconds
    assert r / s == pytest.approx(2 * HW.switch_efficiency() / HW.tcp_efficiency(), rel=0.01)


def test_an_oversubscribed_uplink_slows_the_switch_only_past_one_host_link():
    at = {o: model.predict("aggnet-switch", HW, model.Shape(8, 32, oversubscription=o), 64 * MiB) for o in (4, 64)}
    assert at[4].bottleneck == "host link"  # the uplink carries S: 32 links over 4 still beat one
    assert at[64].bottleneck == "uplink" and at[64].seconds == pytest.approx(2 * at[4].seconds, rel=0.01)
    ring = {o: model.predict("ring", HW, model.Shape(8, 32, oversubscription=o), 64 * MiB) for o in (1, 4)}
    assert ring[4].seconds > ring[1].seconds


def test_a_small_window_or_loss_makes_the_switch_wait_on_round_trips():
    small = HW.replace(switch_window=4)
    p = model.predict("aggnet-switch", small, model.Shape(2, 8), 64 * MiB)
    assert p.bottleneck == "window"
    lossy = model.predict("aggnet-switch", small, model.Shape(2, 8, loss=0.01), 64 * MiB)
    rtt = p.terms["latency"]
    lost = 1 - 0.99 ** 4
    assert lossy.terms["window"] / p.terms["window"] == pytest.approx((rtt + lost * HW.rto) / rtt, rel=1e-6)


def test_jobs_past_the_pool_fall_back_to_the_racks_hosts():
    shape = model.Shape(4, 8)
    fits = HW.switch_pool // HW.switch_window
    inside, past = model.shared_pool(HW, shape, 16 * MiB, fits), model.shared_pool(HW, shape, 16 * MiB, fits + 1)
    assert (inside["on_switch"], inside["fallback"]) == (fits, 0)
    assert (past["on_switch"], past["fallback"]) == (fits, 1)
    assert max(past["seconds"]) > max(inside["seconds"])


def test_hardware_files_start_from_a_preset_and_name_bad_fields(tmp_path):
    f = tmp_path / "hw.json"
    f.write_text(json.dumps({"base": "tofino2-400g", "name": "lab", "switch_window": 64,
                             "sources": {"switch_window": "measured"}}))
    hw = hardware.load(str(f), {"rto": 0.005})
    assert (hw.name, hw.switch_window, hw.rto, hw.host_rate) == ("lab", 64, 0.005, 400 * hardware.GBIT)
    assert hw.sources["switch_window"] == "measured" and "host_rate" in hw.sources
    with pytest.raises(ValueError, match="unknown hardware parameter"):
        hardware.load("tofino-100g", {"window": 3})
    with pytest.raises(ValueError, match="no hardware preset or parameter file"):
        hardware.load(str(tmp_path / "missing.json"))


def test_the_command_predicts_16384_workers_at_once_and_refuses_bad_input(tmp_path):
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, "-m", "aggnet", "sim", "--json", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert [row["workers"] for row in rec["rows"]] == [1024, 2048, 4096, 8192, 16384]
    assert "16384" in r.stdout and "ring/aggnet" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "aggnet", "sim", "--workers", "1000"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "whole racks of 32" in bad.stderr


def test_the_command_draws_its_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need aggnet[plot]")
    r = subprocess.run([sys.executable, "-m", "aggnet", "sim", "--workers", "64,128", "--workers-per-rack", "16",
                        "--plot", str(tmp_path / "sim")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("sim-time.png", "sim-jobs.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- calibration and validation against the emulated fabric --------------------------------------------

def test_validation_points_read_as_written_and_bad_ones_say_the_form():
    from aggnet.sim.validate import Point

    p = Point.parse("2x4@400/100~0.01")
    assert (p.racks, p.workers, p.host_mbit, p.uplink_mbit, p.drop) == (2, 4, 400, 100, 0.01)
    assert str(p) == "2x4@400/100~0.01" and Point.parse(str(p)) == p
    assert str(Point.parse("1x4@100")) == "1x4@100"
    for bad in ("4@100", "1x4", "1x1@100", "1x4@0", "1x4@100~1.5", "axb@c"):
        with pytest.raises(ValueError, match="RACKSxWORKERS|needs a rack"):
            Point.parse(bad)


def test_the_generated_topology_is_one_the_emulation_can_lay_out(tmp_path):
    from aggnet.emulation.fabric_plan import plan
    from aggnet.sim.validate import topology_toml

    f = tmp_path / "racks.toml"
    f.write_text(topology_toml(3))
    pl = plan(str(f), racks=3, workers=4, host_mbit=100, uplink_mbit=50)
    assert len(pl.racks) == 3 and pl.world == 12 and pl.root is not None
    assert {rp.aggregator.kind for rp in pl.racks} == {"host-switch"}


def test_a_shared_machine_adds_every_process_cpu_over_its_cores():
    """On one machine of C cores (an emulation) the workers' and the
    aggregators' CPU-seconds add up and share the cores; with hosts of
    their own the term is absent."""
    cpu = HW.replace(client_cpu_s_per_byte=1e-9, host_agg_cpu_s_per_byte=0.5e-9, ring_cpu_s_per_byte=2e-9)
    shape = model.Shape(2, 4)
    assert "machine cpu" not in model.predict("aggnet-host", cpu, shape, 64 * MiB).terms
    shared = cpu.replace(machine_cores=2)
    host = model.predict("aggnet-host", shared, shape, 64 * MiB)
    taken = 8 * 64 * MiB + 2 * 2 * 64 * MiB  # members' S at the racks; partials up and finals down
    assert host.terms["machine cpu"] == pytest.approx((8 * 64 * MiB * 1e-9 + taken * 0.5e-9) / 2)
    ring = model.ring(shared, shape, 64 * MiB, rack_aware=True)
    assert ring.terms["machine cpu"] == pytest.approx(8 * 2 * 7 / 8 * 64 * MiB * 2e-9 / 2)


def test_validation_predicts_with_the_points_links_and_the_racks_aggregator_link():
    from aggnet.sim.validate import MBIT, Point, hardware_at, predict

    hw = hardware.load("emulation")
    p = Point.parse("2x4@400/100")
    at = hardware_at(hw, p)
    assert at.host_rate == 400 * MBIT and at.host_agg_link_factor == 4
    got = predict(hw, p, 16 * MiB)
    # 4 links of 400 over one uplink of 100: the uplink binds both
    assert got["aggnet"].bottleneck == "uplink" and got["gloo"].bottleneck == "uplink"
    assert got["gloo"].seconds > got["aggnet"].seconds  # the ring sends 2(N-1)/N S through it


def test_calibrate_and_validate_refuse_without_root_or_a_calibration(tmp_path):
    r = subprocess.run([sys.executable, "-m", "aggnet", "sim", "validate", "--hardware", "tofino-100g"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert ("needs root" in r.stderr) or ("run aggnet sim calibrate first" in r.stderr)
    r = subprocess.run([sys.executable, "-m", "aggnet", "sim", "validate", "--points", "1x4@fast"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1


# -- loss, a second level, jobs sharing uplinks, published claims ---------------------------------------

def test_a_lossy_job_that_fills_its_link_waits_a_timeout_of_its_queued_round_trip():
    """aggnet's client sets its timeout to twice the round trips it sees, and
    a job that fills a shaped link sees its whole window queued there."""
    from aggnet.protocol.limits import RTO_MAX

    hw = hardware.load("emulation").replace(host_rate=100e6 / 8)
    clean = model.predict("aggnet-host", hw, model.Shape(1, 4), 16 * MiB)
    lossy = model.predict("aggnet-host", hw, model.Shape(1, 4, loss=0.01), 16 * MiB)
    assert "loss tail" not in clean.terms and clean.bottleneck == lossy.bottleneck == "host link"
    window_bytes = 512 << 10  # what a host gives a job that asks for no window
    queued_rtt = window_bytes / (hw.switch_efficiency(2048) * hw.host_rate) * (1 + (1 - 0.99 ** 2))
    assert lossy.terms["loss tail"] == pytest.approx(2 * queued_rtt, rel=0.01)  # 256 last uses: one is lost
    slow = model.predict("aggnet-host", hw.replace(host_rate=1e6 / 8), model.Shape(1, 4, loss=0.01), 16 * MiB)
    assert slow.terms["loss tail"] == pytest.approx(RTO_MAX, rel=0.01)  # the client's cap


def test_a_second_level_adds_its_measured_round_trip_or_two_more_hops():
    hw = hardware.load("emulation").replace(host_rate=1e9 / 8)
    one = model.predict("aggnet-host", hw, model.Shape(1, 4), 16 * MiB).terms["latency"]
    two = model.predict("aggnet-host", hw, model.Shape(2, 2), 16 * MiB).terms["latency"]
    wire = 2 * 4 * 2048 / hw.switch_efficiency(2048) / hw.host_rate
    assert two - one == pytest.approx(2 * hw.hop_latency + hw.step_latency + wire)
    measured = model.predict("aggnet-host", hw.replace(root_latency=0.5e-3), model.Shape(2, 2), 16 * MiB)
    assert measured.terms["latency"] - one == pytest.approx(0.5e-3 + wire)


def test_uplinks_are_shared_max_min_fairly_so_a_job_held_back_by_hosts_leaves_the_rest():
    assert model.fair_shares(10.0, [1.0, 2.0, 100.0, 100.0]) == pytest.approx([1.0, 2.0, 3.5, 3.5])
    assert model.fair_shares(10.0, [1.0, 2.0]) == [1.0, 2.0]
    shape = model.Shape(4, 8, oversubscription=8)
    fits = HW.switch_pool // HW.switch_window
    past = model.shared_pool(HW, shape, 16 * MiB, fits + 4)
    inside = model.shared_pool(HW, shape, 16 * MiB, fits)
    # the fallback jobs take a sliver of the uplinks: the switch's jobs keep the rest
    assert past["seconds"][0] < inside["seconds"][0] * (1 + 4 / fits)
    assert past["goodput"] >= inside["goodput"]


def test_published_claims_meet_the_model_with_the_papers_parameters(tmp_path):
    from aggnet.sim import published

    r = published.report()
    for by_n in r["switchml"]["speedups"].values():
        values = list(by_n.values())
        assert values == sorted(values)  # the ring's 2(N-1)/N grows with N, the switch's S does not
    # without the ring's step latencies, bytes alone: under 2 S over the switch protocol's S
    for k, by_n in published.switchml_speedups(HW.replace(step_latency=0.0)).items():
        at = HW.replace(switch_elements=k)
        assert max(by_n.values()) < 2 * at.switch_efficiency() / at.tcp_efficiency()
    v = r["switchml"]["verdict"]
    assert not v["agrees"] and v["ring_share_of_line_rate"] == pytest.approx(v["model_ceiling"] / 5.5)
    out = tmp_path / "published.json"
    run = subprocess.run([sys.executable, "-m", "aggnet", "sim", "published", "--json", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "arXiv 1903.06701" in run.stdout and "nsdi21/presentation/lao" in run.stdout
    assert json.loads(out.read_text())["atp"]["rows"][0]["jobs"] == 1


# -- P4 racks (BMv2 in the ToR's place) ----------------------------------------------------------------

def test_p4_points_read_as_written_and_lay_out_p4_racks(tmp_path):
    from aggnet.emulation.fabric_plan import plan
    from aggnet.sim.validate import Point, topology_toml

    p = Point.parse("2x2@1000/0:p4")
    assert p.p4 and (p.racks, p.workers) == (2, 2) and str(p) == "2x2@1000/0:p4" and Point.parse(str(p)) == p
    assert not Point.parse("2x2@1000/0").p4
    with pytest.raises(ValueError, match=":p4"):
        Point.parse("1x2@1000:tofino")
    f = tmp_path / "p4.toml"
    f.write_text(topology_toml(2, p4=True))
    pl = plan(str(f), racks=2, workers=2, host_mbit=1000, uplink_mbit=0)
    assert {rp.aggregator.kind for rp in pl.racks} == {"p4"} and pl.root is not None


def test_a_software_switch_is_bound_by_its_pipeline_passes():
    """A ToR takes W packets per slot and multicasts W copies; under a root
    it also sends one partial up and takes one final back."""
    hw = hardware.load("emulation").replace(host_rate=1e9 / 8, switch_passes_per_s=2000.0)
    packets = 256 * 1024 / (4 * hw.switch_elements)
    one = model.predict("aggnet-switch", hw, model.Shape(1, 4), 256 * 1024)
    assert one.bottleneck == "switch packets"
    assert one.terms["switch packets"] == pytest.approx(2 * 4 * packets / 2000)
    two = model.predict("aggnet-switch", hw, model.Shape(2, 2), 256 * 1024)
    assert two.terms["switch packets"] == pytest.approx((2 * 2 * packets + 2 * packets) / 2000)
    assert "switch packets" not in model.predict("aggnet-switch", HW, model.Shape(1, 4), 256 * 1024).terms


def test_validate_refuses_p4_points_without_a_bmv2_calibration(tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"base": "emulation", "name": "no bmv2"}))
    r = subprocess.run([sys.executable, "-m", "aggnet", "sim", "validate", "--hardware", str(hw), "--points",
                        "1x2@1000:p4"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert ("needs root" in r.stderr) or ("calibration made with it" in r.stderr)
