"""A root and two racks of aggregators as real ``aggnet serve`` processes
on loopback, and the topology file that places workers on them."""

from __future__ import annotations

from aggnet.client import stats as stats_cli
from aggnet.processes import ServiceProcess
from aggnet.protocol.address import parse


def topology_text(kind: str, root: str | None, racks: list[str], per_rack: int, shards: int | None = None,
                  fallbacks: list[str] | None = None, job: str = "hier") -> str:
    extra = f", shards = {shards}" if shards else ""
    lines = [f'job = "{job}"']
    if root is not None:
        lines += ["[root]", f'kind = "{"service" if kind == "service" else "host-switch"}"', f'address = "{root}"']
        if shards:
            lines.append(f"shards = {shards}")
    for i, address in enumerate(racks):
        lines += ["[[racks]]", f'name = "rack{i}"', f'ranks = "{i * per_rack}-{(i + 1) * per_rack - 1}"']
        if kind == "p4":
            lines.append(f'aggregator = {{ kind = "p4", address = "{address}", p4runtime = "127.0.0.1:1" }}')
        else:
            lines.append(f'aggregator = {{ kind = "{kind}", address = "{address}"{extra} }}')
        if fallbacks:
            lines.append(f'fallback = {{ kind = "host-switch", address = "{fallbacks[i]}" }}')
    return "\n".join(lines) + "\n"


class Racks:
    """A root and two racks of one kind, as ``aggnet serve`` processes."""

    def __init__(self, kind: str, shards: int = 2, per_rack: int = 2, root_args=(), rack_args=(),
                 scheme: str = "zmq+tcp"):
        self.kind = kind
        mode = [] if kind == "service" else ["--mode", "switch"]
        listen = f"{scheme}://127.0.0.1:0" if kind == "service" else "udp://127.0.0.1:0"
        self.procs = []
        try:
            self.root = self._start(listen, shards, [*mode, *root_args])
            self.racks = [self._start(listen, shards, [*mode, "--parent", self.root.address, "--rack-id", str(i),
                                                       "--racks", "2", *rack_args]) for i in range(2)]
        except BaseException:
            self.stop()
            raise
        self.topology = topology_text(kind, self.root.address, [r.address for r in self.racks], per_rack,
                                      shards if kind == "service" else None)
        self.world = 2 * per_rack

    def _start(self, listen, shards, args):
        p = ServiceProcess(listen, shards=shards, args=list(args))
        self.procs.append(p)
        return p

    def ports(self, which: list) -> list[int]:
        """Every port the given aggregators listen on (control and shards)."""
        ports = []
        for p in which:
            a = parse(p.address)
            if self.kind == "service":
                # a service on port 0 puts its shards on any free ports
                ports += [a.port] + [parse(s).port for s in self.stats(p)["service"]["shards"]]
            else:
                ports += [a.port + i for i in range(p.shards)]  # switch mode: consecutive ports
        return ports

    def stats(self, p, timeout: float = 5.0) -> dict:
        return stats_cli.query(p.address, timeout)

    def stop(self):
        for p in self.procs:
            p.stop()
