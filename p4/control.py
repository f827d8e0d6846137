"""The switch program's control plane, over P4Runtime (p4runtime-shell).

It loads the pipeline into simple_switch_grpc, installs and removes jobs
(pool slice, admission entries, multicast group and replica addresses,
uplink), sets up ordinary forwarding, resets a job's registers and reads
the counters. Tables, actions and counters are looked up by name through
the P4Info, never by numeric id. Registers cannot be written through
P4Runtime on BMv2 (PI lacks register writes), so a slice is cleared through
BMv2's runtime CLI (Thrift), the one place this module goes around
P4Runtime.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from aggnet.protocol.limits import FLOOD_GROUP, MAX_JOBS, MAX_WORKERS, P4_POOL, Drop, Event
from aggnet.protocol.pool import SlotPool
from aggnet.protocol.wire import job_id_of

from aggnet.p4.compile import BMV2_JSON, P4INFO
from aggnet.p4.tools import find_tool

log = logging.getLogger("aggnet.p4.control")

P = "AggIngress.aggregate."
#: the names of the program's counters by index (limits.p4 is generated from the same enums)
DROP_REASONS = tuple(d.name.lower() for d in Drop)
EVENTS = tuple(e.name.lower() for e in Event)
_SLOT_REGISTERS = ("tag", "count", "seen", "exponent", "max_exponent")


class SwitchControlError(RuntimeError):
    pass


#: BMv2's ports are 9 bits wide, and 511 is its drop port
MAX_SWITCH_PORT = 510
_MAC = re.compile(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}")


def _check_ip(what: str, ip) -> None:
    try:
        ipaddress.IPv4Address(ip)
    except (ipaddress.AddressValueError, ValueError):
        raise ValueError(f"{what}: {ip!r} is not an IPv4 address like 10.77.0.1") from None


def _check_mac(what: str, mac) -> None:
    if not isinstance(mac, str) or not _MAC.fullmatch(mac):
        raise ValueError(f"{what}: {mac!r} is not a MAC address like 02:a6:6e:00:00:01") from None


def _check_port(what: str, port) -> None:
    if not isinstance(port, int) or not 0 <= port <= MAX_SWITCH_PORT:
        raise ValueError(f"{what}: port {port!r} is not a switch port (0..{MAX_SWITCH_PORT})")


@dataclass(frozen=True)
class Member:
    """A worker as the switch sees it: its address and its switch port."""

    ip: str
    mac: str
    port: int


@dataclass(frozen=True)
class Uplink:
    """Where a rack's partial sums go: the parent aggregator."""

    parent_ip: str
    parent_mac: str
    port: int
    rack_id: int


@dataclass
class InstalledJob:
    name: str
    job_id: int
    row: int
    base: int
    slots: int
    world: int
    members: list = field(default_factory=list)

    @property
    def group(self) -> int:
        return self.row + 1

    @property
    def rid_base(self) -> int:
        return self.row * MAX_WORKERS + 1


def _mac(text: str) -> int:
    return int(text.replace(":", ""), 16)


class SwitchControl:
    """A connection to one switch; a context manager."""

    def __init__(self, grpc_addr: str = "127.0.0.1:9559", device_id: int = 0, *, switch_ip: str = "10.77.0.253",
                 switch_mac: str = "02:a6:6e:00:00:fe", thrift_port: int = 9090, netns: str | None = None,
                 election_id: tuple[int, int] = (0, 1), thrift_host: str | None = None):
        self.grpc_addr = grpc_addr
        self.device_id = device_id
        self.switch_ip = switch_ip
        self.switch_mac = switch_mac
        self.thrift_port = thrift_port
        #: where BMv2's runtime CLI server is (None: this machine, or netns)
        self.thrift_host = thrift_host
        self.netns = netns
        self.election_id = election_id
        self._sh = None

    # -- connection ------------------------------------------------------------------

    def connect(self, load_pipeline: bool = False, p4info: Path = P4INFO, bmv2_json: Path = BMV2_JSON) -> "SwitchControl":
        try:
            import p4runtime_sh.shell as sh
        except ImportError as exc:
            raise SwitchControlError("the switch control plane needs p4runtime-shell: pip install 'aggnet[p4]'") from exc
        config = sh.FwdPipeConfig(str(p4info), str(bmv2_json)) if load_pipeline else None
        try:
            sh.setup(device_id=self.device_id, grpc_addr=self.grpc_addr, election_id=self.election_id,
                     config=config, verbose=False)
        except SystemExit:
            # p4runtime-shell exits on errors it has already logged
            raise SwitchControlError(f"could not {'load the pipeline into' if load_pipeline else 'connect to'} the "
                                     f"switch at {self.grpc_addr} (is simple_switch_grpc running?)") from None
        except Exception as exc:
            raise SwitchControlError(f"cannot reach the switch's P4Runtime server at {self.grpc_addr}: {exc}") from None
        self._sh = sh
        if load_pipeline:
            log.info("pipeline loaded into %s from %s", self.grpc_addr, bmv2_json)
        return self

    def close(self) -> None:
        if self._sh is not None:
            try:
                self._sh.teardown()
            finally:
                self._sh = None

    def __enter__(self) -> "SwitchControl":
        return self if self._sh is not None else self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def sh(self):
        if self._sh is None:
            raise SwitchControlError("not connected: call connect() first")
        return self._sh

    # -- ordinary forwarding ------------------------------------------------------------

    def add_host(self, mac: str, port: int) -> None:
        """Frames to ``mac`` leave on ``port``."""
        te = self.sh.TableEntry("AggIngress.forward.l2")(action="AggIngress.forward.to_port")
        te.match["hdr.eth.dst"] = mac
        te.action["port"] = str(port)
        te.insert()

    def set_flood(self, ports: list[int]) -> None:
        """Broadcasts (and unknown destinations) go to every port in ``ports``."""
        g = self.sh.MulticastGroupEntry(FLOOD_GROUP)
        for p in ports:
            g.add(p, 0)
        g.insert()

    # -- jobs -----------------------------------------------------------------------------

    def jobs(self) -> list[InstalledJob]:
        """The jobs installed on the switch, read back from its tables."""
        found = []

        def collect(te):
            job_id = _match_int(te, "hdr.agg.job_id")
            found.append(InstalledJob(name=f"{job_id:08x}", job_id=job_id, row=_param_int(te, "row"),
                                      base=_param_int(te, "base"), slots=_param_int(te, "slots"),
                                      world=_param_int(te, "world")))

        self.sh.TableEntry(P + "jobs").read(function=collect)
        return found

    def install_job(self, name: str, members: list[Member], slots: int = 128, *, base: int | None = None,
                    uplink: Uplink | None = None) -> InstalledJob:
        """Install a job: its slice of the pool (cleared), the admission of
        each member as its bit (its index in ``members``), the multicast
        group of its results with per-member rewrites, and its uplink."""
        world = len(members)
        if not 1 <= world <= MAX_WORKERS:
            raise ValueError(f"a switch job takes 1 to {MAX_WORKERS} members, got {world}")
        if not 1 <= slots <= P4_POOL:
            raise ValueError(f"slots must be 1..{P4_POOL}, got {slots}")
        # every value is checked before the first write: a bad one leaves
        # the switch as it was
        for i, m in enumerate(members):
            what = f"member {i} ({m.ip},{m.mac},{m.port})"
            _check_ip(what, m.ip)
            _check_mac(what, m.mac)
            _check_port(what, m.port)
        if len({m.ip for m in members}) != world:
            raise ValueError(f"job {name!r}: two members have the same address; each worker has its own")
        if uplink is not None:
            what = f"uplink ({uplink.parent_ip},{uplink.parent_mac},{uplink.port},{uplink.rack_id})"
            _check_ip(what, uplink.parent_ip)
            _check_mac(what, uplink.parent_mac)
            _check_port(what, uplink.port)
            if not isinstance(uplink.rack_id, int) or not 0 <= uplink.rack_id < MAX_WORKERS:
                raise ValueError(f"{what}: rack id {uplink.rack_id!r} is not in 0..{MAX_WORKERS - 1}")
        job_id = job_id_of(name)
        existing = self.jobs()
        if any(j.job_id == job_id for j in existing):
            raise SwitchControlError(f"job {name!r} (id {job_id:08x}) is installed already; remove it first")
        row, base = self._place(existing, slots, base)
        job = InstalledJob(name, job_id, row, base, slots, world, list(members))
        self.reset_slice(base, slots)
        undo: list = []  # (what, how to take it back), in the order written
        try:
            self._write_job(job, uplink, undo)
        except Exception as exc:
            failed = []
            for what, take_back in reversed(undo):
                try:
                    take_back()
                except Exception as undo_exc:  # the switch may be gone: say what is left
                    failed.append(f"{what} ({undo_exc})")
            step = getattr(exc, "aggnet_step", "its entries")
            left = (f"; could not take back {', '.join(failed)}: run `aggnet switch remove-job {name}`" if failed
                    else "; nothing of it was left on the switch")
            raise SwitchControlError(f"installing job {name!r} failed writing {step}: {_one_line(exc)}{left}") \
                from None
        log.info("job %r (id %08x) installed: row %d, slots %d..%d, %d members%s", name, job_id, row, base,
                 base + slots - 1, world, f", uplink to {uplink.parent_ip} as rack {uplink.rack_id}" if uplink else "")
        return job

    def _write_job(self, job: InstalledJob, uplink: Uplink | None, undo: list) -> None:
        """Write a job's entries, recording how to take back each one; an
        exception carries the step it failed at."""
        sh = self.sh
        job_id, row, base, slots, world = job.job_id, job.row, job.base, job.slots, job.world

        def write(what: str, entry, take_back) -> None:
            try:
                entry.insert()
            except Exception as exc:
                exc.aggnet_step = what
                raise
            undo.append((what, take_back))

        te = sh.TableEntry(P + "jobs")(action=P + "job")
        te.match["hdr.agg.job_id"] = str(job_id)
        params = {"row": row, "base": base, "slots": slots, "world": world, "group": job.group,
                  "rid_base": job.rid_base, "uplink": 1 if uplink else 0, "rack_id": uplink.rack_id if uplink else 0,
                  "parent_ip": uplink.parent_ip if uplink else "0.0.0.0",
                  "parent_mac": uplink.parent_mac if uplink else "00:00:00:00:00:00",
                  "parent_port": uplink.port if uplink else 0,
                  "switch_ip": self.switch_ip, "switch_mac": self.switch_mac}
        for k, v in params.items():
            te.action[k] = str(v)
        write("its jobs table entry", te, lambda: self._delete_job_entry(job_id))
        group = sh.MulticastGroupEntry(job.group)
        for bit, m in enumerate(job.members):
            adm = sh.TableEntry(P + "admission")(action=P + "admit")
            adm.match["hdr.agg.job_id"] = str(job_id)
            adm.match["hdr.agg.sender"] = str(bit)
            adm.match["hdr.ipv4.src"] = m.ip
            write(f"member {bit}'s admission", adm, adm.delete)
            rep = sh.TableEntry("AggEgress.replicas")(action="AggEgress.to_member")
            rep.match["sm.egress_rid"] = str(job.rid_base + bit)
            rep.action["mac"] = m.mac
            rep.action["ip"] = m.ip
            write(f"member {bit}'s result address", rep, rep.delete)
            group.add(m.port, job.rid_base + bit)
        write(f"multicast group {job.group}", group, group.delete)

    def _delete_job_entry(self, job_id: int) -> None:
        te = self.sh.TableEntry(P + "jobs")
        te.match["hdr.agg.job_id"] = str(job_id)
        te.delete()

    @staticmethod
    def _place(existing: list[InstalledJob], slots: int, base: int | None) -> tuple[int, int]:
        """A free row and the first free run of ``slots`` slots, or the run
        from ``base`` when that is free."""
        try:
            pool = SlotPool.holding(P4_POOL, MAX_JOBS, ((j.row, j.base, j.slots) for j in existing))
        except ValueError as exc:
            raise SwitchControlError(f"the switch's installed jobs overlap ({exc}): remove them first") from None
        row = pool.free_row()
        if row is None:
            raise SwitchControlError(f"the switch holds {MAX_JOBS} jobs already")
        if base is None:
            place = pool.place(slots)
            if place is None:
                raise SwitchControlError(f"no free run of {slots} slots in the pool of {P4_POOL}")
            return place
        try:
            pool.take(row, base, slots)
        except ValueError as exc:
            raise SwitchControlError(f"cannot place the job at base {base}: {exc}") from None
        return row, base

    def remove_job(self, name: str) -> int:
        """Remove whatever part of job ``name`` is on the switch (a job
        written by an older control plane may be half there); returns how
        many entries went. Raises if there was none."""
        job_id = job_id_of(name)
        job = next((j for j in self.jobs() if j.job_id == job_id), None)
        sh = self.sh
        admitted = []
        sh.TableEntry(P + "admission").read(
            function=lambda te: admitted.append(te) if _match_int(te, "hdr.agg.job_id") == job_id else None)
        removed = 0
        for te in admitted:
            te.delete()
            removed += 1
        if job is not None:
            for bit in range(MAX_WORKERS):  # a half-written job's world may not be all there
                rep = sh.TableEntry("AggEgress.replicas")
                rep.match["sm.egress_rid"] = str(job.rid_base + bit)
                try:
                    rep.delete()
                    removed += 1
                except Exception:
                    pass  # not written
            try:
                sh.MulticastGroupEntry(job.group).delete()
                removed += 1
            except Exception:
                pass  # not written
            self._delete_job_entry(job_id)
            removed += 1
        if not removed:
            raise SwitchControlError(f"job {name!r} is not installed (`aggnet switch jobs` lists what is)")
        log.info("job %r removed (%d entries)", name, removed)
        return removed

    # -- registers and counters -----------------------------------------------------------

    def reset_slice(self, base: int, slots: int) -> None:
        """Clear a slice's slot registers (both versions) so a new job
        starts from empty slots, through BMv2's runtime CLI."""
        lines = []
        for name in _SLOT_REGISTERS:
            for version in (0, 1):
                for s in range(base, base + slots):
                    lines.append(f"register_write {P}{name} {version * P4_POOL + s} 0")
        self._cli("\n".join(lines) + "\n")

    def _cli(self, commands: str) -> str:
        tool = find_tool("simple_switch_CLI")
        if tool is None:
            raise SwitchControlError("simple_switch_CLI (BMv2's runtime CLI, which clears a job's registers) is not "
                                     "on PATH; install BMv2 (docs/p4.md) or put its bin/ directory on PATH")
        cmd = [tool, "--thrift-port", str(self.thrift_port)]
        if self.thrift_host:
            cmd += ["--thrift-ip", self.thrift_host]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        r = subprocess.run(cmd, input=commands, capture_output=True, text=True, timeout=120)
        if r.returncode != 0 or "Error" in r.stdout:
            raise SwitchControlError(f"BMv2 runtime CLI failed: {(r.stderr or r.stdout).strip()[-500:]}")
        return r.stdout

    def counters(self) -> dict:
        """Drops by reason, events, and completions per job row."""
        sh = self.sh
        out: dict = {"drops": {}, "events": {}, "completions": {}}

        def reader(target: dict, names):
            def read(ce):
                i = ce.index
                n = ce.data.packet_count
                if n:
                    target[names[i] if names and i < len(names) else i] = n
            return read

        sh.CounterEntry(P + "drops").read(function=reader(out["drops"], DROP_REASONS))
        sh.CounterEntry(P + "events").read(function=reader(out["events"], EVENTS))
        sh.CounterEntry(P + "completions").read(function=reader(out["completions"], None))
        return out


def _one_line(exc: Exception) -> str:
    """A P4Runtime error (often several lines of gRPC detail) in one line."""
    text = " ".join(str(exc).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(exc).__name__)


def _match_int(te, field_name: str) -> int:
    """An exact match field of a table entry read back from the switch."""
    return int.from_bytes(te.match[field_name].exact.value, "big")


def _param_int(te, name: str) -> int:
    """An action parameter of a table entry read back from the switch."""
    return int.from_bytes(te.action[name].value, "big")
