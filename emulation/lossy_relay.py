"""A UDP middlebox that drops, duplicates and reorders datagrams.

It sits between N workers and one aggregator with one port pair per worker
(a worker-facing port and an aggregator-facing one), so the aggregator still
sees every worker at a distinct address, and it impairs both directions
with a seeded random generator: the same seed gives the same impairments.
Network namespaces with iptables ``statistic`` give random drops (and TEE
duplicates) on real links; reordering needs netem, which this kernel lacks,
so this relay is how the protocol is tested under reorder.
"""

from __future__ import annotations

import random
import select
import socket
import threading
from collections import Counter


class LossyRelay:
    def __init__(self, aggregator: tuple, workers: int, *, drop: float = 0.0, duplicate: float = 0.0,
                 reorder: float = 0.0, seed: int = 0, host: str = "127.0.0.1"):
        for name, p in (("drop", drop), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} probability must be in [0, 1), got {p}")
        self.aggregator = aggregator
        self.drop, self.duplicate, self.reorder = drop, duplicate, reorder
        self.rng = random.Random(seed)
        self.counters: Counter = Counter()
        self.front = []
        self.back = []
        for _ in range(workers):
            f = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            f.bind((host, 0))
            b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            b.bind((host, 0))
            for s in (f, b):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            self.front.append(f)
            self.back.append(b)
        self.worker_addr: list = [None] * workers
        self._held: list = []  # (socket, data, destination) waiting to be released late
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aggnet-lossy-relay", daemon=True)

    @property
    def addresses(self) -> list[str]:
        """The address each worker should use as its aggregator."""
        return [f"udp://{f.getsockname()[0]}:{f.getsockname()[1]}" for f in self.front]

    def start(self) -> "LossyRelay":
        self._thread.start()
        return self

    def _impair(self, sock, data: bytes, dest) -> None:
        self.counters["seen"] += 1
        r = self.rng.random
        if r() < self.drop:
            self.counters["dropped"] += 1
            return
        copies = 2 if r() < self.duplicate else 1
        self.counters["duplicated"] += copies - 1
        for _ in range(copies):
            if r() < self.reorder:
                # hold it back: it leaves after a few later datagrams
                self._held.append([self.rng.randint(1, 8), sock, data, dest])
                self.counters["reordered"] += 1
            else:
                self._send(sock, data, dest)
        self._release()

    def _release(self, flush: bool = False) -> None:
        keep = []
        for item in self._held:
            item[0] -= 1
            if item[0] <= 0 or flush:
                self._send(*item[1:])
            else:
                keep.append(item)
        self._held = keep

    def _send(self, sock, data, dest) -> None:
        try:
            sock.sendto(data, dest)
        except OSError:
            self.counters["send_errors"] += 1

    def _run(self) -> None:
        index = {s: ("front", i) for i, s in enumerate(self.front)}
        index.update({s: ("back", i) for i, s in enumerate(self.back)})
        sockets = self.front + self.back
        while not self._stop.is_set():
            ready, _, _ = select.select(sockets, [], [], 0.01)
            if not ready:
                self._release(flush=True)  # nothing else moves: let held datagrams go
                continue
            for s in ready:
                try:
                    data, src = s.recvfrom(65536)
                except OSError:
                    continue
                side, i = index[s]
                if side == "front":
                    self.worker_addr[i] = src
                    self._impair(self.back[i], data, self.aggregator)
                elif self.worker_addr[i] is not None:
                    self._impair(self.front[i], data, self.worker_addr[i])

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for s in self.front + self.back:
            s.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
