"""The floor of ``aggnet bench``: a parameter server in plain TCP sockets.

Each worker sends every chunk of its buffer to the shard that owns it and
receives the chunk's sum straight into its buffer; each shard (a process,
one per core as the service has) sums with numpy and sends each sum to every
worker. The same chunks and the same bytes through the same kernel as the
service over zmq+tcp, with nothing else: no framing beyond a 16-byte header,
no admission, loss recovery, codec or accounting, and no copy the kernel
does not make itself (the first contribution becomes the sum; results land
in the worker's buffer).

Why it is here: on one host every byte that crosses a socket costs the
kernel's copies on both ends, and a parameter server moves 2N buffer sizes
through them where gloo's ring moves 2(N-1). This floor, timed in the same
run, shows what any parameter server can reach on the machine at hand, so
the distance from aggnet to it (what aggnet's own work costs) is read
apart from the distance from it to gloo (what the topology costs here).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import signal
import socket
import struct
import sys
import threading

import numpy as np

_HELLO = struct.Struct("!II")  # rank, world
_HEADER = struct.Struct("!IIII")  # round, chunk index, payload bytes, dtype code
_DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.int32)}
_CODES = {v: k for k, v in _DTYPES.items()}
#: seconds a worker waits for its all-reduce's sums before it gives up
WAIT_S = 300.0


def aggnet_chunk_bytes(uplink_mbit: float | None = None) -> int:
    """The chunks the floor moves: aggnet's over zmq+tcp, the transport it
    stands beside, under a root whose uplinks run at ``uplink_mbit``."""
    from aggnet.client.config import ClientConfig

    return ClientConfig().chunk_bytes_for("zmq+tcp", uplink_mbit)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise EOFError("the peer closed its connection")
        got += r


def serve_shard(world: int, ready, index: int = 0, host: str = "127.0.0.1", hold: bool = False,
                parent: tuple[str, int] | None = None, rack: int = 0, racks: int = 1) -> None:
    """One floor shard: accept ``world`` workers, then sum what they send
    until they close. ``ready.put((index, port))`` says where it listens.
    ``parent`` (a root floor shard's address): each sum goes up as rack
    ``rack`` of ``racks``, and the root's sum comes back down. ``hold``:
    then wait to be killed, so that whoever reads its CPU time after the
    workers are gone still finds it."""
    up = None
    if parent is not None:
        up = socket.create_connection(parent, timeout=60)
        up.settimeout(None)
        up.sendall(_HELLO.pack(rack, racks))
    listener = socket.create_server((host, 0))
    ready.put((index, listener.getsockname()[1]))
    conns: list = [None] * world
    for _ in range(world):
        conn, _ = listener.accept()
        hello = bytearray(_HELLO.size)
        _recv_exactly(conn, memoryview(hello))
        conns[_HELLO.unpack(hello)[0]] = conn
    listener.close()
    _Shard(conns, up).run()
    while hold:
        signal.pause()
    os._exit(0)  # its senders wait on their outboxes for ever


def start_shards(ctx, world: int, count: int, host: str = "127.0.0.1", hold: bool = False,
                 parents: list | None = None, rack: int = 0, racks: int = 1) -> tuple[list, list[int]]:
    """``count`` floor shards as processes of ``ctx`` (a multiprocessing
    context), shard i under ``parents[i]`` where given; their processes
    and, in shard order, their ports. None is left running if one does
    not say where it listens within a minute."""
    ready = ctx.Queue()
    parents = parents or [None] * count
    procs = [ctx.Process(target=serve_shard, args=(world, ready, i, host, hold, parents[i], rack, racks), daemon=True)
             for i in range(count)]
    for proc in procs:
        proc.start()
    try:
        ports = dict(ready.get(timeout=60) for _ in procs)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return procs, [ports[i] for i in range(count)]


class _Shard:
    """A floor shard's sums: a thread each way per connection, a lock
    around the sums, buffers reused by size."""

    def __init__(self, conns: list, up: socket.socket | None):
        self.conns, self.up, self.world = conns, up, len(conns)
        self.lock = threading.Lock()
        self.pool: dict[int, list] = {}
        self.sums: dict = {}  # (round, index) -> [buffer, contributions]
        self.outboxes = [queue.SimpleQueue() for _ in conns]
        self.sending: dict = {}  # id(buffer) -> sends left
        self.upbox: queue.SimpleQueue = queue.SimpleQueue()
        self.held: dict = {}  # (round, index) -> a sum gone up, where the root's comes back

    def run(self) -> None:
        """Until every worker has closed."""
        receivers = [threading.Thread(target=self.receive, args=(r,), daemon=True) for r in range(self.world)]
        others = [threading.Thread(target=self.send, args=(r,), daemon=True) for r in range(self.world)]
        if self.up is not None:
            others += [threading.Thread(target=self.send_up, daemon=True),
                       threading.Thread(target=self.receive_down, daemon=True)]
        for t in receivers + others:
            t.start()
        for t in receivers:
            t.join()

    def take(self, nbytes: int) -> np.ndarray:
        free = self.pool.get(nbytes)
        return free.pop() if free else np.empty(nbytes, np.uint8)

    def receive(self, rank: int) -> None:
        conn, header, buf = self.conns[rank], bytearray(_HEADER.size), None
        try:
            while True:
                _recv_exactly(conn, memoryview(header))
                rnd, idx, nbytes, code = _HEADER.unpack(header)
                with self.lock:
                    if buf is None or len(buf) != nbytes:
                        buf = self.take(nbytes)
                _recv_exactly(conn, memoryview(buf))
                with self.lock:
                    entry = self.sums.get((rnd, idx))
                    if entry is None:
                        # the first contribution is the sum so far: no copy
                        self.sums[(rnd, idx)] = entry = [buf, 0]
                        buf = self.take(nbytes)
                    else:
                        dt = _DTYPES[code]
                        acc = entry[0].view(dt)
                        np.add(acc, buf.view(dt), out=acc)
                    entry[1] += 1
                    done = entry[1] == self.world
                    if done:
                        del self.sums[(rnd, idx)]
                        if self.up is not None:
                            self.held[(rnd, idx)] = entry[0]
                if done:
                    if self.up is None:
                        self.fan_out(bytes(header), entry[0])
                    else:
                        self.upbox.put((bytes(header), entry[0]))
        except (EOFError, OSError):
            return

    def fan_out(self, header: bytes, result: np.ndarray) -> None:
        with self.lock:
            self.sending[id(result)] = self.world
        for box in self.outboxes:
            box.put((header, result))

    def send(self, rank: int) -> None:
        try:
            while True:
                header, result = self.outboxes[rank].get()
                self.conns[rank].sendall(header)
                self.conns[rank].sendall(result)
                with self.lock:
                    left = self.sending[id(result)] - 1
                    if left:
                        self.sending[id(result)] = left
                    else:
                        del self.sending[id(result)]
                        self.pool.setdefault(len(result), []).append(result)
        except OSError:
            return

    def send_up(self) -> None:
        try:
            while True:
                header, partial = self.upbox.get()
                self.up.sendall(header)
                self.up.sendall(partial)
        except OSError:
            return

    def receive_down(self) -> None:
        """The root's sums, each into the buffer its rack's partial went up
        from (the root answers only once it has all of that partial)."""
        header = bytearray(_HEADER.size)
        try:
            while True:
                _recv_exactly(self.up, memoryview(header))
                rnd, idx, _, _ = _HEADER.unpack(header)
                with self.lock:
                    result = self.held.pop((rnd, idx))
                _recv_exactly(self.up, memoryview(result))
                self.fan_out(bytes(header), result)
        except (EOFError, OSError):
            return


class FloorClient:
    """A worker's side of the floor: one connection per shard, a thread
    each way per connection, every chunk sent from and received into the
    caller's buffer."""

    def __init__(self, ports: list[int], rank: int, world: int, chunk_bytes: int, host: str = "127.0.0.1"):
        self.chunk_bytes = chunk_bytes
        self._round = 0
        self._conns = []
        for port in ports:
            conn = socket.create_connection((host, port), timeout=60)
            conn.settimeout(None)
            conn.sendall(_HELLO.pack(rank, world))
            self._conns.append(conn)
        self._work = [queue.SimpleQueue() for _ in ports]
        self._done = [threading.Semaphore(0) for _ in ports]
        self._dest: memoryview | None = None
        self._expect = [0] * len(ports)
        self._failed: list = []
        self._threads = [threading.Thread(target=self._sender, args=(i,), daemon=True) for i in range(len(ports))]
        self._threads += [threading.Thread(target=self._receiver, args=(i,), daemon=True) for i in range(len(ports))]
        for t in self._threads:
            t.start()

    def _chunks(self, nbytes: int, shard: int) -> list[tuple[int, int, int]]:
        n = len(self._conns)
        starts = range(0, nbytes, self.chunk_bytes)
        return [(i, s, min(s + self.chunk_bytes, nbytes)) for i, s in enumerate(starts) if i % n == shard]

    def allreduce(self, buf: np.ndarray) -> None:
        """Sum ``buf`` (float32 or int32) over every worker, in place."""
        self._round += 1
        raw = memoryview(buf.reshape(-1).view(np.uint8))
        self._dest = raw
        code = _CODES[buf.dtype]
        waiting = []
        for shard, work in enumerate(self._work):
            chunks = self._chunks(len(raw), shard)
            self._expect[shard] = len(chunks)
            if chunks:  # a buffer smaller than the shards' count of chunks leaves some out
                work.put((self._round, code, raw, chunks))
                waiting.append(shard)
        for shard in waiting:
            if not self._done[shard].acquire(timeout=WAIT_S):
                raise RuntimeError(f"floor shard {shard} sent no sums within {WAIT_S:g}s")
        if self._failed:
            raise RuntimeError(f"floor all-reduce failed: {self._failed[0]}")

    def _sender(self, shard: int) -> None:
        conn = self._conns[shard]
        while True:
            item = self._work[shard].get()
            if item is None:
                return
            rnd, code, raw, chunks = item
            try:
                for i, start, end in chunks:
                    conn.sendall(_HEADER.pack(rnd, i, end - start, code))
                    conn.sendall(raw[start:end])
            except OSError as exc:  # its receiver hears the close too, and wakes the caller
                self._failed.append(f"shard {shard}: {exc}")
                return

    def _receiver(self, shard: int) -> None:
        conn = self._conns[shard]
        header = bytearray(_HEADER.size)
        got = 0
        try:
            while True:
                _recv_exactly(conn, memoryview(header))
                _, i, nbytes, _ = _HEADER.unpack(header)
                start = i * self.chunk_bytes
                _recv_exactly(conn, self._dest[start:start + nbytes])
                got += 1
                if got == self._expect[shard]:
                    got = 0
                    self._done[shard].release()
        except (EOFError, OSError) as exc:
            self._failed.append(f"shard {shard}: {exc}")
            self._done[shard].release()

    def close(self) -> None:
        for work in self._work:
            work.put(None)
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


def parse_address(text: str) -> tuple[str, list[int]]:
    """``HOST:PORT,PORT...`` (what ``main`` prints) as (host, ports)."""
    host, _, ports = text.rpartition(":")
    return host, [int(p) for p in ports.split(",")]


def main(argv=None) -> int:
    """``python -m aggnet.bench.floor --world N --shards K --host IP``: the
    floor's shards as processes under this one (where an emulated
    aggregator host runs it); prints ``floor serving HOST:PORT,...`` and
    ends, with its shards, when its standard input closes (the shards
    live on after their workers close, so their CPU time can be read)."""
    p = argparse.ArgumentParser(prog="python -m aggnet.bench.floor")
    p.add_argument("--world", type=int, required=True, help="workers each shard waits for")
    p.add_argument("--shards", type=int, default=os.cpu_count() or 1, help="shard processes (default: one per core)")
    p.add_argument("--host", default="127.0.0.1", help="address the shards listen on")
    p.add_argument("--parent", default=None,
                   help="a root floor's HOST:PORT,... (what it printed): shard i sends its sums to the root's "
                        "shard i and hands the root's sums to its workers")
    p.add_argument("--rack", type=int, default=0, help="with --parent: this rack's number, from 0")
    p.add_argument("--racks", type=int, default=1, help="with --parent: the root's racks")
    args = p.parse_args(argv)
    parents = [None] * args.shards
    if args.parent:
        root, ports = parse_address(args.parent)
        if len(ports) != args.shards:
            p.error(f"--parent has {len(ports)} shards and this floor {args.shards}: give both the same")
        parents = [(root, port) for port in ports]
    shards, ports = start_shards(multiprocessing.get_context("fork"), args.world, args.shards, args.host, True,
                                 parents, args.rack, args.racks)
    try:
        print(f"floor serving {args.host}:{','.join(map(str, ports))}", flush=True)
        sys.stdin.read()
    finally:
        for s in shards:
            s.kill()
            s.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
