"""Partition count from Parallax's cost model: the least-squares fit, the
doubling/halving search over a real (timed) measure, and ``aggnet tune``
end to end against a service it starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from aggnet.client.partitions import Fit, choose, fit, search

THETA = (0.004, 0.064, 0.001)  # minimum at P = sqrt(0.064 / 0.001) = 8


def model(p: int, theta=THETA) -> float:
    return theta[0] + theta[1] / p + theta[2] * p


def test_fit_recovers_theta_from_exact_samples():
    samples = {p: model(p) for p in (1, 2, 4, 8, 16, 32)}
    f = fit(samples)
    np.testing.assert_allclose((f.theta0, f.theta1, f.theta2), THETA, rtol=1e-9, atol=1e-12)
    assert f.best(1, 32) == 8
    # three samples determine the model exactly too
    f3 = fit({p: model(p) for p in (2, 4, 16)})
    np.testing.assert_allclose((f3.theta0, f3.theta1, f3.theta2), THETA, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"3 or more partition counts.*\[2, 4\]"):
        fit({2: 1.0, 4: 1.0})


def test_choose_stays_in_the_sampled_range_and_takes_the_fastest_without_a_fit():
    # time falling all the way: the fit's minimum lies beyond; choose the largest sampled P
    p, f = choose({p: model(p, (0.0, 1.0, 0.0)) for p in (1, 2, 4)})
    assert p == 4 and f is not None
    assert choose({1: 0.5, 2: 0.3}) == (2, None)
    assert str(Fit(1.0, 2.0, 3.0)).startswith("iter_time(P) = 1 + 2/P + 3*P")


def sleeping_measure(visited: list, scale: float = 4.0):
    """A real measurement: the wall time of a sleep that lasts as long as
    the model says (scaled), the fastest of three (sleeps only overshoot)."""
    def measure(p: int) -> float:
        visited.append(p)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            time.sleep(scale * model(p))
            best = min(best, time.perf_counter() - t0)
        return best
    return measure


def test_search_doubles_until_slower_then_halves_until_slower_and_fit_finds_the_minimum():
    visited: list[int] = []
    samples = search(sleeping_measure(visited), 2)
    # 2 -> 4 -> 8 (faster each time) -> 16 slower: stop; 1 slower than 2: stop
    assert visited == [2, 4, 8, 16, 1]
    p, f = choose(samples)
    assert p == 8, (samples, f)
    # overshoot of the sleeps lands in theta0; the shape is the model's
    assert f.theta1 == pytest.approx(4 * THETA[1], rel=0.15) and f.theta2 == pytest.approx(4 * THETA[2], rel=0.3)


def test_search_from_above_halves_to_the_minimum_and_respects_bounds():
    visited: list[int] = []
    samples = search(sleeping_measure(visited), 32, hi=32)
    assert visited == [32, 16, 8, 4]  # no doubling past hi; halving stops once slower
    assert choose(samples)[0] == 8
    with pytest.raises(ValueError, match=r"P=64, outside \[1, 32\]"):
        search(sleeping_measure([]), 64, hi=32)


def test_aggnet_tune_measures_a_table_and_prints_the_fit():
    t0 = time.monotonic()
    env = {**os.environ}
    env.pop("AGGNET_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "aggnet", "tune", "--rows", "4000", "--width", "8", "--steps", "3",
                          "--start", "2", "--max-partitions", "16", "--alpha", "0.02"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "P=2 " in text and "samples (P: ms per step):" in text, text
    assert "fit: theta0 = " in text or "too few samples" in text, text
    chosen = int(text.strip().splitlines()[-1].split(":")[1])
    sampled = [int(s.split(":")[0]) for s in text.split("samples (P: ms per step): ")[1].splitlines()[0].split(", ")]
    assert len(sampled) >= 2 and min(sampled) <= chosen <= max(sampled)
    assert time.monotonic() - t0 < 20


def test_aggnet_tune_says_what_is_wrong():
    out = subprocess.run([sys.executable, "-m", "aggnet", "tune", "--alpha", "0"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "--alpha must be in (0, 1]" in out.stderr
    out = subprocess.run([sys.executable, "-m", "aggnet", "tune", "--address", "zmq+ipc:///nonexistent/x.sock",
                          "--rows", "10", "--timeout", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "aggnet tune: cannot connect 2 workers" in out.stderr, out.stderr
