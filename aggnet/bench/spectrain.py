"""``aggnet bench-spectrain``: SpecTrain's experiments in small, each a
printed table, a JSON file and a plot.

* ``prediction`` (the paper's Fig. 8): how far the predicted weights
  W_{t-s} - s·η·v and the stale weights W_{t-s} are from the true W_t,
  for s = 1..3, on a 16-layer SELU MLP of width 256 trained with momentum
  SGD;
* ``modes`` (its Table 1): the one-process pipeline emulator
  (:func:`aggnet.pipeline.emulate`, bit-identical to the distributed run)
  with 4 and 8 stages in all four modes, several seeds and learning
  rates: best train and validation loss, best validation accuracy and
  the spread of the last evaluations;
* ``stale``: stale-gradient data parallelism (:func:`aggnet.torch.stale.
  emulate`, bit-identical to DDP through aggnet with two ranks) with s =
  1, 2, with and without prediction, against synchronous training.

The task is the same everywhere: a fixed random teacher network labels
Gaussian inputs (10 classes, 5% of the labels flipped), so the runs need
no download and every seed sees the same data in its own order.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

FEATURES, CLASSES = 32, 10


def add_arguments(p) -> None:
    p.add_argument("what", choices=["prediction", "modes", "stale"],
                   help="prediction: the weight predictor's error; modes: the pipeline's modes side by side; "
                        "stale: stale-gradient data parallelism beside synchronous")
    p.add_argument("--seeds", type=int, default=5, help="seeds per configuration (default %(default)s)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: 400 for prediction, 2000 for modes, 1000 for stale)")
    p.add_argument("--lrs", default=None, help="learning rates, comma-separated (default: per experiment)")
    p.add_argument("--stages", default="4,8", help="modes: pipeline depths (default %(default)s)")
    p.add_argument("--replicas", type=int, default=4, help="stale: data-parallel workers (default %(default)s)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs in parallel (default: one per core)")
    p.add_argument("--json", default=None, help="write the records here (default: bench-spectrain-WHAT.json)")
    p.add_argument("--plot", default=None, help="draw the figure here (default: bench-spectrain-WHAT.png)")


# -- the task ----------------------------------------------------------------------------


def dataset(train: int = 60000, valid: int = 5000):
    """Inputs and labels of the teacher task: (x_train, y_train, x_valid, y_valid)."""
    import torch

    g = torch.Generator().manual_seed(2024)
    teacher = [torch.randn(FEATURES, 64, generator=g) / FEATURES ** 0.5,
               torch.randn(64, CLASSES, generator=g) / 8.0]
    x = torch.randn(train + valid, FEATURES, generator=g)
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)
    flip = torch.rand(len(y), generator=g) < 0.05
    y[flip] = torch.randint(0, CLASSES, (int(flip.sum()),), generator=g)
    return x[:train], y[:train], x[train:], y[train:]


def batches(x, y, steps: int, batch: int, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps:
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - batch + 1, batch):
            idx = order[i:i + batch]
            out.append((x[idx], y[idx]))
            if len(out) == steps:
                break
    return out


def mlp_blocks(depth: int = 8, width: int = 128, seed: int = 0):
    """``depth`` blocks (Linear then ReLU; the last a Linear alone), to be cut
    into stages of equal depth."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU())]
    blocks += [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 2)]
    blocks.append(nn.Linear(width, CLASSES))
    for b in blocks[:-1]:  # He initialisation: the signal keeps its scale through the depth
        nn.init.kaiming_normal_(b[0].weight, nonlinearity="relu")
        nn.init.zeros_(b[0].bias)
    return blocks


def sgd(params, lr: float):
    """Momentum SGD as the paper runs it: v = γ·v + (1-γ)·g, γ = 0.9."""
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=0.9, dampening=0.9)


def evaluate(forward, x, y) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        out = forward(x)
        return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def summary(curve: list[dict]) -> dict:
    """Best train and validation loss, best validation accuracy, and the
    spread of the last quarter of the evaluations (how much a run still
    wobbles at the end)."""
    tail = curve[-max(2, len(curve) // 4):]

    def lowest(key):  # a diverged run's losses are NaN: its best is what it reached before
        finite = [c[key] for c in curve if math.isfinite(c[key])]
        return min(finite) if finite else math.inf

    return {"best_train_loss": lowest("train_loss"),
            "best_valid_loss": lowest("valid_loss"),
            "best_valid_acc": max(c["valid_acc"] for c in curve),
            "last_valid_acc": curve[-1]["valid_acc"],
            # over the whole run: how fast it got there, not only where it ended
            "mean_valid_acc": statistics.fmean(c["valid_acc"] for c in curve),
            "last_spread": statistics.pstdev(c["valid_acc"] for c in tail),
            "diverged": not math.isfinite(curve[-1]["valid_loss"])}


# -- the runs (one process each) ---------------------------------------------------------------


def run_pipeline(mode: str, stages: int, lr: float, seed: int, steps: int, every: int | None = None) -> dict:
    import torch
    import torch.nn as nn

    from aggnet.pipeline import Stage, emulate

    torch.set_num_threads(1)
    every = every or max(1, steps // 10)
    xt, yt, xv, yv = dataset()
    blocks = mlp_blocks(seed=seed)
    per = len(blocks) // stages
    pipe = []
    for k in range(stages):
        module = nn.Sequential(*blocks[k * per:(k + 1) * per])
        pipe.append(Stage(module, sgd(module.parameters(), lr), index=k, stages=stages, mode=mode,
                          loss_fn=nn.functional.cross_entropy))
    whole = nn.Sequential(*[s.module for s in pipe])
    curve, train_losses = [], []

    def on_loss(_replica, batch, loss):
        train_losses.append(loss)

    data = batches(xt, yt, steps, 32, seed)
    t0 = time.perf_counter()
    for start in range(0, steps, every):
        # the pipeline drains for each evaluation (as a run that evaluates or
        # checkpoints does), so every stage holds the weights of the same batches
        emulate(pipe, data[start:start + every], on_loss=on_loss)
        vl, va = evaluate(whole, xv, yv)
        curve.append({"step": start + every, "train_loss": statistics.fmean(train_losses[-every:]),
                      "valid_loss": vl, "valid_acc": va})
    return {"mode": mode, "stages": stages, "lr": lr, "seed": seed, "steps": steps, "curve": curve,
            "seconds": time.perf_counter() - t0, **summary(curve)}


def run_stale(staleness: int, predict: bool, replicas: int, lr: float, seed: int, steps: int,
              every: int | None = None) -> dict:
    import torch
    import torch.nn as nn

    from aggnet.torch.stale import emulate

    torch.set_num_threads(1)
    every = every or max(1, steps // 10)
    xt, yt, xv, yv = dataset()
    models = [nn.Sequential(*mlp_blocks(seed=seed)) for _ in range(replicas)]
    opts = [sgd(m.parameters(), lr) for m in models]
    data = [batches(xt, yt, steps, 32, seed * 100 + r) for r in range(replicas)]
    curve = []
    losses: list[float] = []

    def on_step(t):
        losses.append(0.0)
        if (t + 1) % every == 0:
            vl, va = evaluate(models[0], xv, yv)
            curve.append({"step": t + 1, "train_loss": float("nan"), "valid_loss": vl, "valid_acc": va})

    t0 = time.perf_counter()
    got = emulate(models, opts, data, nn.functional.cross_entropy, staleness=staleness, predict=predict,
                  on_step=on_step)
    for c in curve:
        window = got[0][c["step"] - every:c["step"]]
        c["train_loss"] = statistics.fmean(window)
    return {"staleness": staleness, "predict": predict, "replicas": replicas, "lr": lr, "seed": seed,
            "steps": steps, "curve": curve, "seconds": time.perf_counter() - t0, **summary(curve)}


def prediction_errors(steps: int = 400, lr: float = 0.05, seed: int = 0, horizon: int = 3) -> dict:
    """Fig. 8 in small: per s, the mean over steps of ||Ŵ - W_t|| / ||W_t||
    for Ŵ = W_{t-s} - s·lr·v (predicted) and Ŵ = W_{t-s} (stale)."""
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    width, depth = 256, 16
    layers = [nn.Linear(FEATURES, width), nn.SELU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.SELU()]
    layers.append(nn.Linear(width, CLASSES))
    model = nn.Sequential(*layers)
    opt = sgd(model.parameters(), lr)
    params = list(model.parameters())
    xt, yt, _, _ = dataset()
    history = []  # (weights, lr·v) after each step

    def flat(ts):
        return torch.cat([t.reshape(-1) for t in ts])

    for x, y in batches(xt, yt, steps, 32, seed):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        history.append((flat([p.detach() for p in params]).clone(),
                        flat([opt.state[p]["momentum_buffer"] for p in params]) * lr))
    out = {"steps": steps, "lr": lr, "seed": seed, "by_s": []}
    warm = steps // 8  # past the first steps, where v is still building up
    for s in range(1, horizon + 1):
        pred, stale = [], []
        for t in range(warm + s, steps):
            w_then, step_then = history[t - s]
            w_now = history[t][0]
            norm = float(w_now.norm())
            pred.append(float((w_then - s * step_then - w_now).norm()) / norm)
            stale.append(float((w_then - w_now).norm()) / norm)
        out["by_s"].append({"s": s, "predicted": statistics.fmean(pred), "stale": statistics.fmean(stale),
                            "ratio": statistics.fmean(pred) / statistics.fmean(stale)})
    return out


# -- tables and plots ----------------------------------------------------------------------


def _pool_map(fn, calls: list[tuple], jobs: int, label) -> list[dict]:
    """Run ``fn(*call)`` for every call, ``jobs`` at a time, printing each
    result's line as it lands."""
    from aggnet.processes import fork_server

    results = [None] * len(calls)
    t0 = time.perf_counter()
    ctx = fork_server()
    with ctx.Pool(max(1, jobs)) as pool:
        pending = [(i, pool.apply_async(fn, call)) for i, call in enumerate(calls)]
        done = 0
        for i, res in pending:
            results[i] = res.get(timeout=3600)
            done += 1
            print(f"[{done}/{len(calls)} {time.perf_counter() - t0:6.0f}s] {label(results[i])}", flush=True)
    return results


def _group(records: list[dict], keys: tuple) -> dict:
    groups: dict = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def _stats(values: list[float]) -> tuple[float, float]:
    if not all(math.isfinite(v) for v in values):
        return math.inf, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table(records: list[dict], keys: tuple) -> list[dict]:
    """Per configuration: mean and standard deviation over seeds."""
    rows = []
    for key, rs in sorted(_group(records, keys).items(), key=lambda kv: str(kv[0])):
        row = dict(zip(keys, key))
        for m in ("best_train_loss", "best_valid_loss", "best_valid_acc", "last_valid_acc", "mean_valid_acc",
                  "last_spread"):
            row[m], row[m + "_std"] = _stats([r[m] for r in rs])
        row["seeds"] = len(rs)
        row["diverged"] = sum(r["diverged"] for r in rs)
        rows.append(row)
    return rows


def _print_rows(rows: list[dict], keys: tuple) -> None:
    head = " ".join(f"{k:>9}" for k in keys)
    print(f"{head} {'best train loss':>17} {'best valid loss':>17} {'best valid acc %':>16} "
          f"{'last valid acc %':>16} {'mean valid acc %':>16} {'last spread':>11} seeds diverged")
    for r in rows:
        lead = " ".join(f"{str(r[k]):>9}" for k in keys)
        print(f"{lead} {r['best_train_loss']:8.4f}±{r['best_train_loss_std']:.4f} "
              f"{r['best_valid_loss']:8.4f}±{r['best_valid_loss_std']:.4f} "
              f"{100 * r['best_valid_acc']:8.2f}±{100 * r['best_valid_acc_std']:5.2f} "
              f"{100 * r['last_valid_acc']:8.2f}±{100 * r['last_valid_acc_std']:5.2f} "
              f"{100 * r['mean_valid_acc']:8.2f}±{100 * r['mean_valid_acc_std']:5.2f} "
              f"{100 * r['last_spread']:11.2f} {r['seeds']:>5} {r['diverged']:>8}")


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def main(args) -> int:
    what = args.what
    json_path = args.json or f"bench-spectrain-{what}.json"
    plot_path = args.plot or f"bench-spectrain-{what}.png"
    lrs = [float(v) for v in args.lrs.split(",")] if args.lrs else None
    if what == "prediction":
        steps = args.steps or 400
        calls = [(steps, lr, seed) for lr in (lrs or [0.01, 0.05]) for seed in range(args.seeds)]
        records = _pool_map(prediction_errors, calls, args.jobs,
                            lambda r: f"lr {r['lr']} seed {r['seed']}: " + ", ".join(
                                f"s={b['s']} predicted/stale {b['ratio']:.3f}" for b in r["by_s"]))
        print(f"{'lr':>5} {'s':>2} {'predicted':>10} {'stale':>10} {'predicted/stale':>16}   (relative L2 error "
              f"against W_t, mean over steps and {args.seeds} seeds)")
        summary_rows = []
        for lr, runs in sorted(_group(records, ("lr",)).items()):
            for s in range(1, 4):
                pred = statistics.fmean(r["by_s"][s - 1]["predicted"] for r in runs)
                stale = statistics.fmean(r["by_s"][s - 1]["stale"] for r in runs)
                summary_rows.append({"lr": lr[0], "s": s, "predicted": pred, "stale": stale, "ratio": pred / stale})
                print(f"{lr[0]:>5g} {s:>2} {pred:10.2e} {stale:10.2e} {pred / stale:16.3f}")
        drawn = _draw(_plot_prediction, summary_rows, plot_path)
        out = {"experiment": what, "summary": summary_rows, "runs": records}
    elif what == "modes":
        from aggnet.pipeline import MODES

        steps = args.steps or 2000
        depths = [int(v) for v in args.stages.split(",")]
        calls = [(mode, n, lr, seed, steps) for n in depths for lr in (lrs or [0.05, 0.1, 0.2])
                 for mode in MODES for seed in range(args.seeds)]
        records = _pool_map(run_pipeline, calls, args.jobs,
                            lambda r: f"N={r['stages']} {r['mode']:>9} lr {r['lr']} seed {r['seed']}: best valid "
                                      f"acc {100 * r['best_valid_acc']:.2f}% ({r['seconds']:.0f}s)")
        drawn, out = _tabulate(what, records, ("stages", "lr", "mode"), _plot_modes, plot_path)
    else:
        steps = args.steps or 1000
        configs = [(0, False), (1, False), (1, True), (2, False), (2, True)]
        calls = [(s, p, args.replicas, lr, seed, steps) for lr in (lrs or [0.1, 0.2, 0.3]) for s, p in configs
                 for seed in range(args.seeds)]
        records = _pool_map(run_stale, calls, args.jobs,
                            lambda r: f"s={r['staleness']} predict={r['predict']} lr {r['lr']} seed {r['seed']}: "
                                      f"best valid acc {100 * r['best_valid_acc']:.2f}% ({r['seconds']:.0f}s)")
        drawn, out = _tabulate(what, records, ("lr", "staleness", "predict"), _plot_stale, plot_path)
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {json_path}" + (f" and {plot_path}" if drawn else
                                  " (no plot: matplotlib is not installed; pip install 'aggnet[plot]')"))
    return 0


def _tabulate(what: str, records: list[dict], keys: tuple, plot, plot_path: str) -> tuple[bool, dict]:
    """The table over seeds, printed and drawn; (drawn, what the JSON holds)."""
    rows = table(records, keys)
    _print_rows(rows, keys)
    return _draw(plot, rows, plot_path), {"experiment": what, "table": rows, "runs": records}


def _draw(plot, rows: list[dict], path: str) -> bool:
    """Draw the figure where matplotlib is installed (an optional extra)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return False
    plot(rows, path)
    return True


def _plot_prediction(summary_rows: list[dict], plot_path: str) -> None:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for lr in sorted({r["lr"] for r in summary_rows}):
        sel = [r for r in summary_rows if r["lr"] == lr]
        xs = [r["s"] for r in sel]
        line = ax.plot(xs, [r["stale"] for r in sel], "o-", label=f"stale $W_{{t-s}}$, lr {lr:g}")
        ax.plot(xs, [r["predicted"] for r in sel], "s--", color=line[0].get_color(),
                label=f"predicted $W_{{t-s}} - s\\eta v$, lr {lr:g}")
    ax.set_xlabel("version difference s")
    ax.set_ylabel("relative error against $W_t$")
    ax.set_yscale("log")
    ax.set_xticks([1, 2, 3])
    ax.set_title("weight prediction, 16-layer SELU MLP")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_path, dpi=120)


def _plot_modes(rows: list[dict], path: str) -> None:
    plt = _figure()
    depths = sorted({r["stages"] for r in rows})
    lrs = sorted({r["lr"] for r in rows})
    fig, axes = plt.subplots(1, len(depths), figsize=(5 * len(depths), 3.5), squeeze=False)
    for ax, n in zip(axes[0], depths):
        from aggnet.pipeline import MODES

        present = {r["mode"] for r in rows if r["stages"] == n}
        modes = [m for m in MODES if m in present]
        width = 0.8 / len(modes)
        for j, mode in enumerate(modes):
            sel = [next(r for r in rows if r["stages"] == n and r["lr"] == lr and r["mode"] == mode) for lr in lrs]
            ax.bar([i + j * width for i in range(len(lrs))], [100 * r["best_valid_acc"] for r in sel], width,
                   yerr=[100 * r["best_valid_acc_std"] for r in sel], label=mode, capsize=2)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(lrs))], [f"lr {lr:g}" for lr in lrs])
        low = min(100 * r["best_valid_acc"] for r in rows) - 3
        ax.set_ylim(max(0, low), None)
        ax.set_ylabel("best validation accuracy %")
        ax.set_title(f"{n} stages, mean ± std over seeds")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_stale(rows: list[dict], path: str) -> None:
    plt = _figure()
    lrs = sorted({r["lr"] for r in rows})
    width = 0.8 / len(lrs)
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    labels = []
    for j, lr in enumerate(lrs):
        sel = [r for r in rows if r["lr"] == lr]
        xs = [i + j * width for i in range(len(sel))]
        ax.bar(xs, [100 * r["last_valid_acc"] for r in sel], width,
               yerr=[100 * r["last_valid_acc_std"] for r in sel], label=f"lr {lr:g}", capsize=2)
        labels = [("sync" if not r["staleness"] else f"s={r['staleness']}" + (" +pred" if r["predict"] else ""))
                  for r in sel]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels)
    finite = [100 * r["last_valid_acc"] for r in rows]
    ax.set_ylim(max(0, min(finite) - 3), max(finite) + 2)
    ax.set_ylabel("validation accuracy % at the end")
    ax.set_title("stale-gradient data parallelism, mean ± std over seeds")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
