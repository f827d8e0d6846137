"""``aggnet bench``: aggnet all-reduce beside torch.distributed gloo and a
memory copy, in one run, on the same buffers.

N worker processes are started once per world size; for every system,
transport, dtype and size they meet at a barrier, all-reduce, and report
their time; a repetition's time is the slowest worker's (the collective is
done when the last worker has its result). The table shows medians and the
ratio gloo / aggnet (above 1: aggnet is faster); ``--json`` writes one record
per measurement. The aggregator's own summation speed is read from its
shards' counters and set beside the memory-copy bandwidth.

Each point also reports CPU-seconds per GB of buffer: a worker's (user +
system of its process, every thread included, over the timed repetitions,
averaged over workers) and, for aggnet, the aggregator's (its supervisor
and shard processes together), so host cycles per byte stand beside
gloo's workers in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

from aggnet.bench import rounds
from aggnet.bench.args import at_least_one, count_list, size_list
from aggnet.bench.cpu import own_cpu_seconds, per_gb, tree_cpu_seconds
from aggnet.progress import Progress
from aggnet.processes import fork_server, free_port
from aggnet.client.config import format_size, parse_size

DEFAULT_SIZES = "1MiB,16MiB,100MiB"


def add_arguments(p) -> None:
    p.add_argument("--workers", type=count_list, default="2,4",
                   help="worker counts, comma-separated (default %(default)s)")
    p.add_argument("--sizes", type=size_list, default=DEFAULT_SIZES, help="buffer sizes (default %(default)s)")
    p.add_argument("--transports", default="shm,ipc,tcp",
                   help="aggnet transports: shm (shared-memory payloads), ipc (ZeroMQ over a Unix socket), tcp "
                        "(plain sockets, tcp://), zmq+tcp (ZeroMQ over TCP; records before 2026-12-07 call it tcp), "
                        "ucx (default %(default)s)")
    p.add_argument("--dtypes", default="float32,int32",
                   help="float32, int32, q-int32 (float32 quantized to int32, exponents agreed every round), "
                        "q-int32-carried (the same under a key, exponents carried from the last round; averaged, so "
                        "that the values keep their scale from one repetition to the next as a model's gradients do), "
                        "o-int32, o-int32-carried (int32 handed over by its owner, which quantizes it once the "
                        "exponents are agreed or carried, as a GPU bucket is: the host's share of such a bucket); "
                        "s-DTYPE: the same in shared memory (aggnet.shared_array), which an shm service reads in "
                        "place, as a GPU bucket's staging buffer is")
    p.add_argument("--chunk-bytes", default=None, help="aggnet chunk sizes to compare (default: the default chunk)")
    p.add_argument("--shards", type=at_least_one, default=None, help="aggregator shards (default: one per core)")
    p.add_argument("--reps", type=at_least_one, default=7, help="timed repetitions per point (default %(default)s)")
    p.add_argument("--rounds", type=at_least_one, default=1,
                   help="time every system this many times, alternating (each round rotates the order), and give "
                        "each round's ratios: systems timed side by side share the machine's drift "
                        "(default %(default)s)")
    p.add_argument("--no-gloo", action="store_true", help="skip torch.distributed gloo")
    p.add_argument("--no-restore", action="store_true",
                   help="aggnet clients do not save what each result overwrites for a failed round "
                        "(all_or_nothing=False, as aggnet.torch's clients): then the shards also write the results "
                        "of an s- buffer into it themselves")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the floor: a parameter server in plain TCP sockets moving the same chunks, what any "
                        "parameter server pays on this machine (aggnet/bench/floor.py)")
    p.add_argument("--memory", choices=("host", "cuda"), default="host",
                   help="where the buffers live: cuda puts them on the GPU (CuPy); aggnet then sends them as they "
                        "are over ucx (dev), staged by the client through pinned memory (staged) and through a "
                        "pinned host copy made by hand (copy); gloo all-reduces CUDA tensors (default %(default)s)")
    p.add_argument("--json", default=None, help="write the records to this file")
    p.add_argument("--codec", choices=("float32", "int32"), default="float32",
                   help="--collective reduce_scatter: how the aggnet backend's (and the client's) float32 travels, "
                        "as AGGNET_CODEC says (default %(default)s)")
    p.add_argument("--collective", choices=("allreduce", "reduce_scatter"), default="allreduce",
                   help="reduce_scatter: the torch.distributed aggnet backend's reduce-scatter and all-reduce beside "
                        "gloo and the aggnet client, over shm (aggnet/bench/collectives.py; uses --workers, "
                        "--sizes, --shards, --reps, --memory, --codec, --json)")


def _system_info() -> dict:
    return {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _timed(barrier, fn, reps: int, rank: int = 0, aggregator: list | None = None) -> dict:
    """Times of ``reps`` calls of ``fn`` after a warm-up, this worker's
    CPU-seconds over them, and (rank 0, when given the aggregator's pids)
    the aggregator's, between barriers that every worker passes."""
    fn()  # warm-up: first-touch page faults, connection set-up, JIT
    barrier.wait(120)
    agg0 = tree_cpu_seconds(aggregator) if aggregator and rank == 0 else None
    cpu0 = own_cpu_seconds()
    times = []
    for _ in range(reps):
        barrier.wait(120)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    cpu = own_cpu_seconds() - cpu0
    barrier.wait(120)
    agg = tree_cpu_seconds(aggregator) - agg0 if agg0 is not None else None
    return {"times": times, "cpu_s": cpu, "aggregator_cpu_s": agg}


def _fill(buf: np.ndarray, rank: int) -> None:
    buf[...] = rank + 1


def _worker(rank: int, world: int, plan: list, services: dict, reps: int, gloo: bool, aggregator: list | None,
            port: int, barrier) -> list:
    from aggnet import Client, shared_array
    from aggnet.bench.floor import FloorClient

    results = []
    if gloo:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    clients: dict = {}
    try:
        for point in plan:
            system, transport, dtype, nbytes, chunk = (point[k] for k in ("system", "transport", "dtype", "bytes", "chunk_bytes"))
            shared = dtype.startswith(SHARED) and system != "gloo"
            dtype = dtype.removeprefix(SHARED)
            np_dtype = np.int32 if dtype == "int32" or _owned(dtype) else np.float32
            # in shared memory, as a GPU bucket's staging buffer is for a
            # service on its host: the shards read it where it lies
            buf = shared_array(nbytes // 4, np_dtype) if shared else np.empty(nbytes // 4, np_dtype)
            _fill(buf, rank)
            on_gpu = point.get("memory") == "cuda"
            if system == "gloo":
                import torch
                import torch.distributed as dist

                t = torch.from_numpy(buf)
                if on_gpu:
                    t = t.cuda()

                    def reduce_on_gpu():
                        dist.all_reduce(t)
                        torch.cuda.synchronize()

                    times = _timed(barrier, reduce_on_gpu, reps)
                else:
                    times = _timed(barrier, lambda: dist.all_reduce(t), reps)
            elif system == "floor":
                if "floor" not in clients:
                    clients["floor"] = FloorClient(services["floor"], rank, world, chunk)
                times = _timed(barrier, lambda: clients["floor"].allreduce(buf), reps, rank, aggregator)
                _check(buf, world, reps, f"rank {rank}: floor/{dtype}")
            elif on_gpu:
                device_path = {"dev": "direct", "staged": "staged"}.get(point["path"])
                key = (transport, chunk, device_path)
                if key not in clients:
                    clients[key] = Client(services[transport],
                                          job=f"bench-{world}-{transport}-{chunk}-{device_path or 'host'}",
                                          rank=rank, world_size=world, chunk_bytes=chunk, timeout=_round_timeout(),
                                          device_path=device_path)
                times = _timed(barrier, _device_allreduce(clients[key], buf, point["path"],
                                                          "int32" if _quantized(dtype) else None), reps, rank,
                               aggregator)
                _check(buf, world, reps, f"rank {rank}: {system}/{transport}/{dtype}/{point['path']}")
            else:
                restore = point.get("restore", True)
                key = (transport, chunk, restore)
                if key not in clients:
                    clients[key] = Client(services[transport], job=f"bench-{world}-{transport}-{chunk}-{restore}",
                                          rank=rank, world_size=world, chunk_bytes=chunk, timeout=_round_timeout(),
                                          all_or_nothing=restore)
                c = clients[key]
                codec = "int32" if _quantized(dtype) else None
                # under a key, averaged: the scale stays what it was, so the
                # exponents carried from one repetition fit the next
                op, name = ("avg", 0) if dtype.endswith("-carried") else ("sum", None)
                if _owned(dtype):
                    owned = _owner(buf, rank, c.chunk_bytes // 4)
                    times = _timed(barrier, lambda: c.allreduce(buf, codec=codec, key=name, _quantized=owned).result(
                        300), reps, rank, aggregator)
                    # each round's owner writes rank+1 again: the sum is the warm-up's
                    _check(buf, world, reps, f"rank {rank}: {system}/{transport}/{dtype}", want=world * (world + 1) / 2)
                else:
                    times = _timed(barrier, lambda: c.allreduce(buf, op=op, codec=codec, key=name).result(300), reps,
                                   rank, aggregator)
                    # the warm-up sums rank+1 over ranks; every repetition then
                    # all-reduces the previous result again
                    _check(buf, world, reps, f"rank {rank}: {system}/{transport}/{dtype}",
                           want=(world + 1) / 2 if op == "avg" else None)
            results.append(times)
    finally:
        for c in clients.values():
            c.close()
        if gloo:
            import torch.distributed as dist

            dist.destroy_process_group()
    return results


DTYPES = ("float32", "int32", "q-int32", "q-int32-carried", "o-int32", "o-int32-carried")
#: a dtype's buffer in shared memory (aggnet.shared_array): s-float32, s-o-int32...
SHARED = "s-"


def _quantized(dtype: str) -> bool:
    """float32 through the int32 codec: quantized by the client (q-) or by its owner (o-)."""
    return dtype.removeprefix(SHARED).startswith(("q-", "o-"))


def _owned(dtype: str) -> bool:
    return dtype.removeprefix(SHARED).startswith("o-")


def _peer_dtypes(dtypes: list) -> list:
    """The dtypes gloo and the floor are timed at: each unquantized one
    once, a shared buffer's as its own (they read no shared memory)."""
    return list(dict.fromkeys(d.removeprefix(SHARED) for d in dtypes if not _quantized(d)))


def _owner(buf: np.ndarray, rank: int, block: int):
    """What the owner of an int32 buffer it quantizes itself gives the
    client: its chunks' exponents (rank+1 < 2**3 everywhere) and a
    quantizer that writes rank+1 where it is asked, as a GPU bucket's
    stager writes the bucket quantized on the device (whose time is the
    device's, not the host's, and is not here)."""
    from aggnet.client.codec import Quantized

    def quantize(agreed, chunks):
        if chunks is None:
            buf[...] = rank + 1
        for i in chunks or ():
            buf[i * block:(i + 1) * block] = rank + 1

    return Quantized(np.full(-(-buf.size // block), 3, np.int16), quantize)


def _check(buf, world: int, reps: int, what: str, want: float | None = None) -> None:
    """The warm-up sums rank+1 over ranks; every repetition then
    all-reduces the previous result again (``want``: what it is otherwise)."""
    want = world * (world + 1) / 2 * world ** reps if want is None else want
    if not np.isclose(float(buf[0]), want, rtol=1e-3) or not np.isclose(float(buf[-1]), want, rtol=1e-3):
        raise AssertionError(f"{what} gave {buf[0]} and {buf[-1]}, want {want}")


def _device_allreduce(client, buf: np.ndarray, path: str, codec):
    """An all-reduce of ``buf``'s values on the GPU, ``path`` "dev" (the
    device buffer as it is, over ucx), "staged" (the device buffer given to
    a client that stages it through pinned memory) or "copy" (through a
    pinned host buffer, as one would stage it by hand); ``buf`` holds the
    result after each call, for the check."""
    import cupy
    import cupyx

    dev = cupy.asarray(buf)
    pinned = cupyx.empty_pinned(buf.shape, buf.dtype)

    def through_device():
        client.allreduce(dev, codec=codec).result(300)

    def through_copy():
        dev.get(out=pinned)
        client.allreduce(pinned, codec=codec).result(300)
        dev.set(pinned)
        cupy.cuda.get_current_stream().synchronize()

    fn = through_copy if path == "copy" else through_device

    def timed():
        fn()
        buf[0], buf[-1] = float(dev[0]), float(dev[-1])

    return timed


def _memcpy_times(nbytes: int, reps: int) -> list[float]:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return times


def _record(point: dict, workers: int, times: list[float], cpu: list[float] | None = None,
            aggregator_cpu: float | None = None) -> dict:
    """One point: times, and CPU-seconds per GB of buffer (per worker,
    averaged; and the aggregator's) when measured."""
    r = {**point, "workers": workers, "median_s": statistics.median(times), "min_s": min(times),
         "max_s": max(times), "reps": len(times), "times": list(times)}
    if cpu is not None:
        r["worker_cpu_s_per_gb"] = per_gb(sum(cpu) / len(cpu), point["bytes"], len(times))
    if aggregator_cpu is not None:
        r["aggregator_cpu_s_per_gb"] = per_gb(aggregator_cpu, point["bytes"], len(times))
    return r


def _run_group(world: int, plan: list, services: dict, reps: int, gloo: bool,
               aggregator: list | None = None) -> dict:
    """{rank: its records' times} of one system's workers; a worker that
    fails stops the benchmark at once with its error (a dead one was
    waited for an hour)."""
    return spawn_workers(_worker, world, (plan, services, reps, gloo, aggregator), 3600, "aggnet bench")


class WorkerFailed(RuntimeError):
    """A benchmark worker's error, in one line; ``details`` holds its
    traceback for whoever debugs the benchmark itself."""

    def __init__(self, text: str, details: str = ""):
        super().__init__(text)
        self.details = details


def _report(target, rank: int, world: int, args: tuple, port: int, barrier, out) -> None:
    try:
        out.put((rank, target(rank, world, *args, port, barrier), None))
    except BaseException as exc:  # the parent must hear of it rather than wait out its timeout
        import traceback

        out.put((rank, None, (f"{type(exc).__name__}: {exc}".splitlines()[0], traceback.format_exc())))
        # the parent says it once, in one line: no traceback from every worker
        raise SystemExit(1) from None


def _round_timeout() -> float:
    """Seconds a benchmark's all-reduce may go without progress: 120 (a
    large buffer on a loaded machine), or what ``AGGNET_TIMEOUT`` says (a
    test's short rounds fail fast, naming what stalled)."""
    return float(os.environ.get("AGGNET_TIMEOUT") or 120)


def spawn_workers(target, world: int, args: tuple, timeout: float, what: str, hint: str = "",
                  preload: tuple | None = None) -> dict:
    """Run ``target(rank, world, *args, port, barrier)`` in ``world`` fresh
    processes (:func:`aggnet.processes.fork_server`) that share a free TCP
    port for their process group and a barrier; {rank: what target
    returned}. A worker that fails, or none answering within ``timeout``,
    raises :class:`WorkerFailed` naming ``what`` (and ``hint``, what to
    try): the benchmark never waits on a dead one.
    ``preload``: what the fork server imports (its default otherwise)."""
    ctx = fork_server() if preload is None else fork_server(preload)
    barrier = ctx.Barrier(world)
    out = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=_report, args=(target, r, world, args, port, barrier, out), daemon=True)
          for r in range(world)]
    for p in ps:
        p.start()
    per_rank = {}
    try:
        for _ in ps:
            try:
                rank, res, err = out.get(timeout=timeout)
            except KeyboardInterrupt:
                # the workers had the same Ctrl-C and end on their own (the
                # interpreter's exit ends any that did not); the caller
                # stops what they used, an aggregator, without waiting for
                # them, before it can log their closed connections
                ps = []
                raise
            except Exception:
                raise WorkerFailed(f"{what}: the N={world} workers gave no result within {timeout:g}s{hint}") \
                    from None
            if err is not None:
                raise WorkerFailed(f"{what}: worker {rank} of {world} failed: {err[0]}", err[1])
            per_rank[rank] = res
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    return per_rank


def _service_stats(address: str) -> dict:
    from aggnet.protocol import wire
    from aggnet.transport import connect

    with connect([address]) as conn:
        conn.send(0, wire.Header(wire.MsgType.STATS).pack())
        msg = conn.recv(10)
    return wire.parse_json(msg.payload) if msg else {}


def main(args) -> int:
    timeout = os.environ.get("AGGNET_TIMEOUT")
    try:
        if timeout and float(timeout) <= 0:
            raise ValueError
    except ValueError:
        print(f"aggnet bench: AGGNET_TIMEOUT={timeout!r} is not a number of seconds above 0 (e.g. 120, how long "
              f"an all-reduce may go without progress); set it so, or unset it", file=sys.stderr)
        return 2
    try:
        return _main(args)
    except WorkerFailed as exc:  # one line; the worker's traceback is exc.details
        print(exc, file=sys.stderr)
        return 1


def _main(args) -> int:
    if getattr(args, "collective", "allreduce") == "reduce_scatter":
        from aggnet.bench.collectives import main as collectives_main

        return collectives_main(args)

    worlds = [int(w) for w in args.workers.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    # None: each transport's own default chunk size
    chunks = [parse_size(c) for c in args.chunk_bytes.split(",")] if args.chunk_bytes else [None]
    for d in dtypes:
        if d.removeprefix(SHARED) not in DTYPES:
            print(f"aggnet bench: unknown dtype {d!r}; choose from {', '.join(DTYPES)}", file=sys.stderr)
            return 2
        if _owned(d) and args.memory == "cuda":
            print(f"aggnet bench: {d} times the host's share of an owner-quantized buffer; run it with --memory "
                  f"host, or time GPU buckets with aggnet bench-ddp --device cuda", file=sys.stderr)
            return 2
    for t in transports:
        if t not in ("shm", "ipc", "tcp", "zmq+tcp", "ucx"):
            print(f"aggnet bench: unknown transport {t!r}; choose from shm, ipc, tcp, zmq+tcp, ucx",
                  file=sys.stderr)
            return 2
    if args.memory == "cuda":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as exc:
            print(f"aggnet bench: --memory cuda needs a CUDA GPU and CuPy ({exc}); pip install aggnet[gpu] on a "
                  f"GPU machine, or leave --memory out", file=sys.stderr)
            return 2
    gloo = not args.no_gloo
    if gloo:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            print("aggnet bench: torch is not installed; running without gloo (pip install aggnet[torch])", file=sys.stderr)
            gloo = False

    # the sockets of the ipc and shm services; gone when the run ends
    with tempfile.TemporaryDirectory(prefix="aggnet-bench-") as run_dir:
        return _run(args, sizes, worlds, transports, dtypes, chunks, gloo, run_dir)


def _run(args, sizes: list, worlds: list, transports: list, dtypes: list, chunks: list, gloo: bool,
         run_dir: str) -> int:
    listen = {"shm": f"shm://{run_dir}/shm.sock", "ipc": f"zmq+ipc://{run_dir}/agg.sock",
              "tcp": "tcp://127.0.0.1:0", "zmq+tcp": "zmq+tcp://127.0.0.1:0", "ucx": "ucx://127.0.0.1:0"}
    records: list[dict] = []
    sums: dict = {}
    for nbytes in sizes:
        records.append(_record({"system": "memcpy", "transport": "memory", "dtype": "float32", "bytes": nbytes,
                                "chunk_bytes": None}, 1, _memcpy_times(nbytes, args.reps)))
    # one system at a time, each with its own service and workers: nothing of
    # one (UCX's progress engines poll) runs while another is timed
    floor = not args.no_floor and args.memory == "host" and any(not _quantized(d) for d in dtypes)
    groups = (["gloo"] if gloo else []) + (["floor"] if floor else []) + transports
    timed: dict[tuple, list[dict]] = {}  # each point's record of every round
    with Progress("aggnet bench", len(worlds) * len(groups) * args.rounds) as progress:
        for r in range(args.rounds):
            for world in worlds:
                for group in rounds.order(groups, r):
                    plan = _plan(group, sizes, dtypes, chunks, listen, args.memory)
                    for point in plan:
                        if point["system"] == "aggnet" and args.no_restore:
                            point["restore"] = False
                    for rec in _time_group(group, world, plan, listen.get(group), args, sums):
                        timed.setdefault(_point_key(rec), []).append(rec)
                    progress.step(f"{group}, {world} workers" + rounds.label(r, args.rounds))
    records += [rounds.merge(recs) for recs in timed.values()]
    _print_table(records)
    if args.rounds > 1:
        for line in _round_lines(records):
            print(line)
    summary, memcpy_bw = _summation_summary(records, sums)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"system_info": _system_info(), "records": records,
                       "aggregator_sum_bytes_per_s": summary, "memcpy_bytes_per_s": memcpy_bw}, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0


def _time_group(group: str, world: int, plan: list[dict], listen: str | None, args, sums: dict) -> list[dict]:
    """The records of one system ("gloo" or a transport, with a service of
    its own) at ``world`` workers; a service's summation totals go into
    ``sums``."""
    from aggnet.processes import ServiceProcess

    if group == "floor":
        return _time_floor(world, plan, args)
    service = None if group == "gloo" else ServiceProcess(listen, args.shards)
    try:
        services = {group: service.address} if service else {}
        per_rank = _run_group(world, plan, services, args.reps, group == "gloo", [service.pid] if service else None)
        if service is not None:
            totals = _service_stats(service.address).get("totals", {})
            acc = sums.setdefault(group, {})
            for k in ("sum_bytes", "sum_seconds"):
                acc[k] = acc.get(k, 0) + totals.get(k, 0)
    finally:
        if service is not None:
            service.stop()
    return _records(plan, world, per_rank, args.reps)


def _time_floor(world: int, plan: list[dict], args) -> list[dict]:
    """The floor's records: its shards (one per core, as the service's)
    are processes of their own, whose CPU counts as the aggregator's."""
    from aggnet.bench.floor import start_shards

    shards, ports = start_shards(fork_server(), world, args.shards or os.cpu_count() or 1)
    try:
        per_rank = _run_group(world, plan, {"floor": ports}, args.reps, False, [p.pid for p in shards])
    finally:
        for p in shards:
            p.join(10)  # a shard ends when its workers close
            if p.is_alive():
                p.kill()
    return _records(plan, world, per_rank, args.reps)


def _records(plan: list[dict], world: int, per_rank: dict, reps: int) -> list[dict]:
    records = []
    for i, point in enumerate(plan):
        slowest = [max(per_rank[r][i]["times"][k] for r in range(world)) for k in range(reps)]
        records.append(_record(point, world, slowest, [per_rank[r][i]["cpu_s"] for r in range(world)],
                               per_rank[0][i]["aggregator_cpu_s"]))
    return records

def _plan(group: str, sizes: list, dtypes: list, chunks: list, listen: dict, memory: str = "host") -> list[dict]:
    """The points one system ("gloo" or a transport) is timed at."""
    from aggnet.bench.floor import aggnet_chunk_bytes
    from aggnet.client.config import ClientConfig

    plan = []
    for nbytes in sizes:
        if group == "gloo":
            plan += [{"system": "gloo", "transport": "tcp", "dtype": d, "bytes": nbytes, "chunk_bytes": None,
                      "memory": memory} for d in _peer_dtypes(dtypes)]
        elif group == "floor":
            # with no codec
            plan += [{"system": "floor", "transport": "tcp", "dtype": d, "bytes": nbytes,
                      "chunk_bytes": aggnet_chunk_bytes(), "memory": memory}
                     for d in _peer_dtypes(dtypes)]
        else:
            # the transport's default chunk size where none is asked for
            scheme = listen[group].split("://", 1)[0]
            # device buffers: as they are where the transport sends device
            # memory (ucx), staged by the client and through a pinned host
            # copy by hand everywhere
            paths = [None] if memory == "host" else (["dev"] if group == "ucx" else []) + ["staged", "copy"]
            plan += [{"system": "aggnet", "transport": group, "dtype": d, "bytes": nbytes,
                      "chunk_bytes": c or ClientConfig().chunk_bytes_for(scheme), "memory": memory, "path": path}
                     for d in dtypes for c in chunks for path in paths]
    return plan


def _summation_summary(records: list[dict], sums: dict) -> tuple[dict, float]:
    """Each service's summation rate, printed beside a memory copy's."""
    # the all-reduce streams whole buffers through memory: compare with the
    # copy of the largest one (the small ones copy within the caches)
    largest = max((r for r in records if r["system"] == "memcpy"), key=lambda r: r["bytes"])
    memcpy_bw = largest["bytes"] / largest["median_s"]
    summary = {}
    for t, totals in sums.items():
        if totals.get("sum_seconds"):
            bw = totals["sum_bytes"] / totals["sum_seconds"]
            summary[t] = bw
            print(f"aggregator summation ({t} service): {bw / 1e9:.2f} GB/s of contributions per CPU-second of "
                  f"summing; memory copy of {format_size(largest['bytes'])} {memcpy_bw / 1e9:.2f} GB/s; "
                  f"ratio {bw / memcpy_bw:.2f}")
    return summary, memcpy_bw

def _print_table(records: list[dict]) -> None:
    gloo = _by_point(records, "gloo")
    floor = _by_point(records, "floor")
    print(f"{'N':>2} {'size':>7} {'system':>7} {'transport':>9} {'dtype':>15} {'chunk':>7} {'median ms':>10} "
          f"{'min ms':>8} {'max ms':>8} {'GB/s':>6} {'gloo/this':>9} {'floor/this':>10} {'cpu s/GB':>8} "
          f"{'agg s/GB':>8}")
    order = {"memcpy": 0, "gloo": 1, "floor": 2}
    for r in sorted(records, key=lambda r: (r["workers"], r["bytes"], order.get(r["system"], 3))):
        ratio = _ratio(gloo, r) if r["system"] in ("aggnet", "floor") else f"{'':>9}"
        to_floor = _ratio(floor, r, 10) if r["system"] == "aggnet" else f"{'':>10}"
        chunk = format_size(r["chunk_bytes"]) if r.get("chunk_bytes") else "-"
        where = r["transport"] + (f"/{r['path']}" if r.get("path") else "/cuda" if r.get("memory") == "cuda" else "")
        cpu = f"{r['worker_cpu_s_per_gb']:8.2f}" if "worker_cpu_s_per_gb" in r else f"{'':>8}"
        agg = f"{r['aggregator_cpu_s_per_gb']:8.2f}" if "aggregator_cpu_s_per_gb" in r else f"{'':>8}"
        print(f"{r['workers']:>2} {format_size(r['bytes']):>7} {r['system']:>7} {where:>9} {r['dtype']:>15} "
              f"{chunk:>7} {r['median_s'] * 1e3:10.1f} {r['min_s'] * 1e3:8.1f} {r['max_s'] * 1e3:8.1f} "
              f"{r['bytes'] / r['median_s'] / 1e9:6.2f} {ratio} {to_floor} {cpu} {agg}")
    if floor:
        print("floor: a parameter server in plain TCP sockets, the same chunks and bytes as aggnet over tcp with "
              "nothing else; floor/this is the share of its speed a system reaches, gloo/this on its row is "
              "what any parameter server can reach against gloo here")


def _point_key(r: dict) -> tuple:
    return tuple(r.get(k) for k in ("system", "transport", "dtype", "bytes", "chunk_bytes", "workers", "path",
                                     "memory"))


def _round_lines(records: list[dict]) -> list[str]:
    """Each round's speed ratios of every aggnet and floor point: gloo's
    time over this one's, and the floor's over aggnet's, in that round."""
    lines = []
    gloo, floor = _by_point(records, "gloo"), _by_point(records, "floor")
    for r in records:
        if r["system"] not in ("aggnet", "floor"):
            continue
        name = (f"N={r['workers']} {format_size(r['bytes'])} {r['system']} {r['transport']} {r['dtype']}"
                + (f" {format_size(r['chunk_bytes'])} chunks" if r.get("chunk_bytes") else ""))
        for ref_name, refs in (("gloo", gloo), ("floor", floor if r["system"] == "aggnet" else {})):
            ref = _at(refs, r)
            if ref is None:
                continue
            each = [a / b for a, b in zip(ref["round_medians"], r["round_medians"])]
            lines.append(f"{name}: {ref_name}/this by round {', '.join(f'{v:.2f}' for v in each)}; median "
                         f"{statistics.median(each):.2f}, range {min(each):.2f}-{max(each):.2f}")
    return lines


def _by_point(records: list[dict], system: str) -> dict:
    return {(r["workers"], r["bytes"], r["dtype"]): r for r in records if r["system"] == system}


def _at(by_point: dict, r: dict) -> dict | None:
    """The record of ``by_point`` at r's point (float32's for a dtype it lacks)."""
    for dtype in (r["dtype"], r["dtype"].removeprefix(SHARED), "float32"):
        if (r["workers"], r["bytes"], dtype) in by_point:
            return by_point[(r["workers"], r["bytes"], dtype)]
    return None


def _ratio(by_point: dict, r: dict, width: int = 9) -> str:
    """The median of ``by_point``'s record at r's point over r's."""
    ref = _at(by_point, r)
    return f"{ref['median_s'] / r['median_s']:{width}.2f}" if ref else f"{'':>{width}}"
