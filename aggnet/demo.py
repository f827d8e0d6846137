"""``aggnet demo``: DDP training through aggnet, the main job.

Trains an MLP on scikit-learn's handwritten digits (shipped with the
package, no download) with PyTorch DDP on 2 worker processes whose
gradients are aggregated by aggnet through an embedded local aggregator
(or ``--address``). Every epoch prints loss, accuracy and the aggregation
throughput; the end prints the test accuracy. ``--compare gloo`` trains the
same model the same way with PyTorch's gloo all-reduce and prints both.

Under torchrun the same training runs with env:// rendezvous::

    torchrun --nproc-per-node 2 -m aggnet.demo --workers 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from aggnet.bench.args import at_least_one, positive_number
from aggnet.errors import AggnetError
from aggnet.processes import DDP_WORKER_PRELOAD, fork_server, free_port, interrupted


def add_arguments(p) -> None:
    p.add_argument("--workers", type=int, default=2, help="DDP worker processes (default %(default)s)")
    p.add_argument("--epochs", type=at_least_one, default=25, help="training epochs (default %(default)s)")
    p.add_argument("--batch", type=at_least_one, default=32, help="batch size per worker (default %(default)s)")
    p.add_argument("--hidden", type=at_least_one, default=1024, help="hidden layer width (default %(default)s)")
    p.add_argument("--lr", type=positive_number, default=0.05, help="SGD learning rate (default %(default)s)")
    p.add_argument("--codec", default="float32", choices=["float32", "int32", "fp16", "bf16"],
                   help="how gradients travel to the aggregator (default %(default)s)")
    p.add_argument("--address", default=None, help="aggregator service (default: embedded local aggregator)")
    p.add_argument("--compare", choices=["gloo"], default=None, help="also train with gloo and compare")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights (default %(default)s)")
    p.add_argument("--job", default=None, help="aggregator job name (default: one agreed over the process group)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the workers train (cuda: GPU rank %% GPUs; the workers may share one)")


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("aggnet demo needs scikit-learn for its data set: pip install 'aggnet[torch]'") from None
    import numpy as np

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(12345).permutation(len(y))
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    mean, std = x[:split].mean(0), x[:split].std(0) + 1e-3
    x = (x - mean) / std
    return (x[:split], y[:split]), (x[split:], y[split:])


def _model(hidden: int, seed: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train(rank: int, world: int, args, mode: str, report=None) -> dict:
    """One DDP worker's training; rank 0 prints progress."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    device = _device(args.device, rank)
    (xtr, ytr), (xte, yte) = _load_digits()
    xtr, ytr, xte, yte = (torch.from_numpy(a).to(device) for a in (xtr, ytr, xte, yte))
    model = _model(args.hidden, args.seed).to(device)
    ddp = DDP(model)
    state = None
    if mode == "aggnet":
        from aggnet.torch import AggnetState, allreduce_hook

        state = AggnetState(args.address, codec=args.codec, job=args.job)
        ddp.register_comm_hook(state, allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        topology = getattr(state, "topology", None)
        where = state.address if state and state.address else (
            f"the racks of {topology}" if topology else "an embedded local aggregator")
        how = f"aggnet ({args.codec}) through {where}" if state else "torch.distributed gloo"
        on = f" on {device}" if device.type != "cpu" else ""
        print(f"[{mode}] {world} DDP workers{on}, MLP 64-{args.hidden}-{args.hidden}-10 ({params:,} parameters, "
              f"{_amount(params * 4)} of gradients per step), gradients via {how}", flush=True)
    try:
        epoch_times = _epochs(rank, world, args, mode, ddp, opt, state, (xtr, ytr))
    finally:
        if state:
            state.close()  # a LEAVE, also when Ctrl-C stops the run: the aggregator forgets the job quietly
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    digest = weights_digest(model)
    result = {"mode": mode, "test_accuracy": acc, "epoch_seconds": epoch_times, "weights": digest}
    if rank == 0:
        print(f"[{mode}] test accuracy {100 * acc:.2f}% on {len(yte)} held-out digits (weights {digest})",
              flush=True)
        if report is not None:
            report.put(result)
    return result


def _device(name: str, rank: int):
    """This worker's device: a GPU each where there are enough, else
    shared (under torchrun, the local rank's)."""
    import torch

    if name == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local % torch.cuda.device_count())


def _no_gpu(args) -> str | None:
    """Why ``--device cuda`` cannot run here, in one line (None: it can).
    torch is imported here only then: the workers fork from a server of
    their own, so this process's CUDA state is not theirs."""
    if args.device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return (f"--device cuda: torch {torch.__version__} sees no CUDA GPU here; train on the CPU (leave --device "
                f"out), or install the CUDA build of torch on a machine with a GPU")
    return None


def weights_digest(model) -> str:
    """A short hash of every weight's bytes: two runs that print the same
    trained bit for bit alike (the int32 codec sums exactly, so faults that
    only cost time leave it unchanged)."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _epochs(rank: int, world: int, args, mode: str, ddp, opt, state, data) -> list[float]:
    """The training epochs; rank 0 prints one line each. Returns their seconds."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    xtr, ytr = data
    model = ddp.module
    g = torch.Generator().manual_seed(args.seed)
    epoch_times = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        perm = torch.randperm(len(ytr), generator=g)  # same on every rank
        per_step = args.batch * world
        steps = len(ytr) // per_step
        totals = torch.zeros(3)
        before = state.stats()["total"] if state else None
        model.train()
        for s in range(steps):
            idx = perm[s * per_step + rank * args.batch: s * per_step + (rank + 1) * args.batch].to(xtr.device)
            out = ddp(xtr[idx])
            loss = nn.functional.cross_entropy(out, ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            totals += torch.tensor([loss.item() * len(idx), (out.argmax(1) == ytr[idx]).sum().item(), len(idx)])
        dist.all_reduce(totals)
        dt = time.perf_counter() - t0
        epoch_times.append(dt)
        if rank == 0:
            line = (f"[{mode}] epoch {epoch:3d}  loss {totals[0] / totals[2]:.4f}  "
                    f"train acc {100 * totals[1] / totals[2]:5.1f}%  {dt:5.2f}s")
            if state:
                after = state.stats()["total"]
                moved = after.wire_bytes - before.wire_bytes
                secs = after.seconds - before.seconds
                line += (f"  aggregated {_amount(moved):>9} in {after.calls - before.calls} buckets, "
                         f"{_amount(moved / max(secs, 1e-9)):>9}/s while in flight")
            print(line, flush=True)
    return epoch_times


def _spawned(rank: int, world: int, port: int, args, mode: str, report) -> None:
    import torch.distributed as dist

    os.environ.setdefault("AGGNET_TIMEOUT", "60")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        train(rank, world, args, mode, report)
        dist.barrier()  # as in _torchrun: nobody tears down while others talk
    except Exception as exc:
        if interrupted(exc):
            os._exit(130)  # Ctrl-C reached every worker: the parent says so once
        text = _failure(exc)
        if text is None:
            raise
        # one line, not a traceback from every process
        print(f"aggnet demo, rank {rank}: {text}{_hint(args, text)}", file=sys.stderr, flush=True)
        os._exit(1)  # the process group's other ranks are stopped by the parent
    except KeyboardInterrupt:
        os._exit(130)  # Ctrl-C reached every worker: the parent says so once
    finally:
        dist.destroy_process_group()


def _failure(exc: BaseException) -> str | None:
    """The aggnet error behind ``exc``, as one line: itself, what caused it,
    or the one that torch names in a RuntimeError's text (a comm hook's
    error reaches ``backward()`` through torch's futures as text: "Got the
    following error when running the callback: NonFiniteError: ...").
    None: not aggnet's."""
    import inspect
    import re

    from aggnet import errors

    seen, chain = exc, set()
    while seen is not None and id(seen) not in chain:
        if isinstance(seen, AggnetError):
            return str(seen)
        chain.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, RuntimeError):
        names = [n for n, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, AggnetError)]
        m = re.search(r"\b(" + "|".join(names) + r"): (.+)", str(exc))
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def _amount(nbytes: float) -> str:
    """Bytes in binary units, one kind throughout the demo's lines (a small
    model's gradients are KiB, not "0.0 MiB")."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _hint(args, text: str) -> str:
    if args.job is None and "has no key for job" in text:
        return ("; the demo names its job itself: run it with --job NAME for a job the service has a key for, "
                "with AGGNET_JOB_KEY set to that key")
    return ""


#: what every demo worker imports: its processes fork from a server that
#: imported these once (torch and scikit-learn cost about 3.5 CPU-seconds
#: each per process), and a fresh process's state is all they share
WORKER_PRELOAD = (*DDP_WORKER_PRELOAD, "sklearn.datasets", "aggnet.demo")


def _run(args, mode: str) -> dict | None:
    """One training run; None when a worker failed (it said why)."""
    ctx = fork_server(WORKER_PRELOAD)
    report = ctx.Queue()
    port = free_port()
    workers = [ctx.Process(target=_spawned, args=(rank, args.workers, port, args, mode, report),
                           name=f"aggnet-demo-{mode}-{rank}") for rank in range(args.workers)]
    for w in workers:
        w.start()
    try:
        if not _all_succeed(workers):
            return None
    except KeyboardInterrupt:
        _stop(workers)
        raise
    return report.get(timeout=10)


def _all_succeed(workers) -> bool:
    """Wait for every worker; at the first that fails, stop the others (its
    peers would wait for it in a collective until their timeout)."""
    from multiprocessing.connection import wait

    running = list(workers)
    while running:
        for sentinel in wait([w.sentinel for w in running]):
            w = next(p for p in running if p.sentinel == sentinel)
            w.join()
            running.remove(w)
            if w.exitcode != 0:
                for other in running:
                    other.terminate()
                _stop(running)
                return False
    return True


#: seconds Ctrl-C gives the workers (who got it too) before they are killed
STOP_GRACE = 5.0


def _stop(processes, grace: float = STOP_GRACE) -> None:
    """Workers told to stop (Ctrl-C reached every one, or SIGTERM after a
    peer failed) exit at once, unless blocked in a collective whose peers
    left (it would hold the terminal until that times out): those are
    killed after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)


def main(args) -> int:
    import importlib.util

    # not imported here: the workers fork from a server that imports it
    if importlib.util.find_spec("torch") is None:
        print("aggnet demo trains with PyTorch: pip install 'aggnet[torch]' (./dev demo sets it up)", file=sys.stderr)
        return 2
    why = _no_gpu(args)
    if why:
        print(f"aggnet demo: {why}", file=sys.stderr)
        return 2
    if "LOCAL_RANK" in os.environ and "RANK" in os.environ:
        return _torchrun(args)
    if args.workers < 1:
        print(f"aggnet demo: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = [_run(args, "aggnet")]
    if args.compare == "gloo" and results[0] is not None:
        results.append(_run(args, "gloo"))
    if None in results:
        print("aggnet demo: a worker failed; its error is above", file=sys.stderr)
        return 1
    print()
    print(f"{'run':>7} {'test acc':>9} {'s/epoch (median)':>17}")
    for r in results:
        med = sorted(r["epoch_seconds"])[len(r["epoch_seconds"]) // 2]
        print(f"{r['mode']:>7} {100 * r['test_accuracy']:8.2f}% {med:17.3f}")
    print(f"done in {time.perf_counter() - t0:.0f}s")
    return 0


def _torchrun(args) -> int:
    """Under torchrun: env:// rendezvous, rank and world from torch.distributed."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        train(dist.get_rank(), dist.get_world_size(), args, "aggnet")
        # rank 0 hosts the rendezvous store: no rank tears its groups down
        # while another still talks to it (an abort at exit otherwise)
        dist.barrier()
    except Exception as exc:
        if interrupted(exc):
            os._exit(130)  # Ctrl-C: torchrun says what stopped
        text = _failure(exc)
        if text is None:
            raise
        print(f"aggnet demo, rank {dist.get_rank()}: {text}{_hint(args, text)}", file=sys.stderr, flush=True)
        os._exit(1)  # torchrun stops the other ranks
    except KeyboardInterrupt:
        os._exit(130)  # Ctrl-C: torchrun says what stopped
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m aggnet.demo", description=__doc__)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
