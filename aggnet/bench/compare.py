"""``aggnet compare``: one benchmark command under two or more settings,
alternated, with the ratio of each pair of runs.

On a shared or small machine the speed of everything drifts by tens of
percent within minutes (docs/benchmarks.md): a benchmark run before a
change and another after it, minutes apart, differ by as much as most
changes are worth. Runs next to each other share the drift, so the ratio
of each pair says what the change did, and the spread of the pairs' ratios
says what a ratio is worth here. The peers a benchmark runs beside aggnet
(gloo, memory copy, the TCP floor) are the same code in every arm: their
pairs' ratios are the machine's own noise, printed beside aggnet's.

An arm is ``NAME[@REV][:VAR=VALUE,...]``:

* ``:VAR=VALUE`` runs the command with those environment settings
  (``off:AGGNET_PREDICT_SCALE=0``);
* ``@REV`` runs it from that git revision of this aggnet checkout,
  exported to a temporary directory (``before@HEAD~1``); an arm without it
  runs the aggnet that is installed.

The order of the arms rotates from pair to pair, so that no arm always
runs first (on a machine that warms up or slows down as it goes).
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from aggnet.bench.args import at_least_one, positive_seconds
from aggnet.progress import Progress

__all__ = ["Arm", "parse_arm", "pair_records", "main"]

#: the commands whose ``--json`` holds records aggnet compare can pair
COMMANDS = ("bench", "bench-ddp", "bench-sparse", "bench-transport", "bench-udp")
#: record fields that are not what a row is (its measurements, and the
#: ranges around a median)
_RANGE = re.compile(r"^(min|max)_")
#: measurements where more is better (rates); the rest are times and costs
_RATE = re.compile(r"_per_s$")


class CompareError(Exception):
    """A bad arm, command or run: one line for the user."""


@dataclass
class Arm:
    name: str
    rev: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: where its aggnet is imported from (set once the arm is ready)
    code: str = ""
    #: the exported tree of ``rev``
    tree: Path | None = None

    def describe(self) -> str:
        parts = ([f"revision {self.rev}"] if self.rev else []) + [f"{k}={v}" for k, v in self.env.items()]
        return f"{self.name} ({', '.join(parts) or 'as installed'})"


def parse_arm(spec: str) -> Arm:
    """``NAME[@REV][:VAR=VALUE,...]`` as an :class:`Arm`."""
    head, _, settings = spec.partition(":")
    name, _, rev = head.partition("@")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise CompareError(f"arm {spec!r}: its name must be letters, digits, '.', '_' or '-' "
                           f"(NAME[@REV][:VAR=VALUE,...], e.g. before@HEAD~1 or off:AGGNET_PREDICT_SCALE=0)")
    if "@" in head and not rev:
        raise CompareError(f"arm {spec!r}: '@' names a git revision, and none follows it")
    env = {}
    for item in filter(None, settings.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            raise CompareError(f"arm {spec!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return Arm(name, rev or None, env)


def add_arguments(p) -> None:
    p.add_argument("--arm", action="append", default=[], metavar="NAME[@REV][:VAR=VALUE,...]",
                   help="a setting to run the command under, at least two; the first is the baseline the others' "
                        "ratios are to (e.g. --arm before@HEAD~1 --arm after, or --arm off:AGGNET_PREDICT_SCALE=0 "
                        "--arm on:AGGNET_PREDICT_SCALE=1)")
    p.add_argument("--pairs", type=at_least_one, default=3,
                   help="runs of every arm, alternated (default %(default)s)")
    p.add_argument("--timeout", type=positive_seconds, default=1800.0,
                   help="seconds one run of the command may take (default %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write every run's records and the paired ratios here")
    p.usage = "aggnet compare --arm NAME[@REV][:VAR=VALUE,...] --arm ... [options] -- COMMAND [ITS OPTIONS]"
    p.add_argument("command", nargs="+", metavar="COMMAND",
                   help=f"the benchmark and its options, after '--': one of {', '.join(COMMANDS)}")


def _checkout() -> Path:
    """The git checkout this aggnet is imported from."""
    here = Path(__file__).resolve().parents[2]
    if not (here / ".git").exists():
        raise CompareError(f"an arm with @REV runs a revision of a git checkout of aggnet, and this aggnet "
                           f"({here}) is not one: install aggnet from a clone (pip install -e .) to compare revisions")
    return here


def export(rev: str, into: Path) -> Path:
    """Revision ``rev`` of the checkout as an importable tree under
    ``into``: its files, with the packages that pyproject.toml places
    inside ``aggnet`` from elsewhere (``aggnet.transport`` from
    ``transport/``) linked into it, so that every aggnet module of the
    arm comes from that revision."""
    repo = _checkout()
    got = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         capture_output=True, text=True, timeout=60)
    if got.returncode != 0:
        raise CompareError(f"{rev!r} is no revision of {repo}: name a commit, branch or tag (git log --oneline)")
    commit = got.stdout.strip()
    tree = into / commit[:12]
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", commit], capture_output=True, timeout=300)
    if archive.returncode != 0:
        raise CompareError(f"git archive {rev} failed: {archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    pyproject = tree / "pyproject.toml"
    dirs = {}
    if pyproject.exists():
        dirs = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {}).get("package-dir", {})
    for package, where in dirs.items():
        parts = package.split(".")
        if len(parts) < 2 or parts[0] != "aggnet":
            continue
        link = tree.joinpath(*parts)
        if not link.exists() and (tree / where).is_dir():
            link.symlink_to((tree / where).resolve(), target_is_directory=True)
    return tree


def _environment(arm: Arm) -> dict[str, str]:
    env = dict(os.environ)
    env.update(arm.env)
    # the working directory must not put another aggnet first
    env["PYTHONSAFEPATH"] = "1"
    if arm.tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(arm.tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _where_from(arm: Arm) -> str:
    """Where the arm's aggnet (and its transports) are imported from."""
    probe = ("import aggnet, aggnet.transport, aggnet.hosts, os; "
             "print(os.path.dirname(aggnet.__file__)); "
             "print(os.path.dirname(os.path.realpath(aggnet.transport.__file__))); "
             "print(os.path.dirname(os.path.realpath(aggnet.hosts.__file__)))")
    got = subprocess.run([sys.executable, "-c", probe], env=_environment(arm), capture_output=True, text=True,
                         timeout=120)
    if got.returncode != 0:
        last = (got.stderr.strip().splitlines() or ["no output"])[-1]
        raise CompareError(f"arm {arm.name}: aggnet does not import under it: {last}")
    package, transport, hosts = got.stdout.splitlines()[-3:]
    if arm.tree is not None:
        root = arm.tree.resolve()
        for path in (package, transport, hosts):
            if not Path(path).resolve().is_relative_to(root):
                raise CompareError(f"arm {arm.name}: part of aggnet ({path}) comes from outside revision "
                                   f"{arm.rev}'s tree {root}: this revision lays its packages out in a way "
                                   f"aggnet compare does not know")
    return package


def _identity_fields(runs: list[dict]) -> set[str]:
    """The fields that say which row a record is: those that are no
    numbers with a fraction and hold the same value in every run for the
    record in the same place (a benchmark writes its records in the same
    order every run); a whole number that differs between runs (bytes a
    worker sent) is a measurement."""
    fields = {k for run in runs for rec in run["records"] for k, v in rec.items()
              if not isinstance(v, (float, list, dict))}
    lengths = {len(run["records"]) for run in runs}
    if len(lengths) != 1:
        return fields
    varying = set()
    for i in range(lengths.pop()):
        for k in fields:
            if len({json.dumps(run["records"][i].get(k)) for run in runs}) > 1:
                varying.add(k)
    # a field that names the record (system, transport) names it even where the order differs
    named = {k for run in runs for rec in run["records"] for k, v in rec.items() if isinstance(v, str)}
    return {k for k in fields if k not in varying or k in named}


def pair_records(runs: list[dict], arms: list[str]) -> list[dict]:
    """Each row's measurements under every arm, and their ratio to the
    first arm's in the same pair of runs. A row is a record's identity
    (:func:`_identity_fields`); its measurements are the rest but the
    ranges around a median (``min_``, ``max_``)."""
    ident_fields = _identity_fields(runs)
    rows: dict[tuple, dict] = {}
    for run in runs:
        for rec in run["records"]:
            ident = tuple(sorted((k, v) for k, v in rec.items() if k in ident_fields))
            row = rows.setdefault(ident, {"row": dict(ident), "values": {}})
            for k, v in rec.items():
                if (k not in ident_fields and isinstance(v, (int, float)) and not isinstance(v, bool)
                        and not _RANGE.match(k)):
                    row["values"].setdefault(k, {}).setdefault(run["arm"], {})[run["pair"]] = float(v)
    # what tells the rows apart, for their labels
    shown = {k for k in ident_fields if len({json.dumps(r["row"].get(k)) for r in rows.values()}) > 1}
    out = []
    base = arms[0]
    for row in rows.values():
        label = " ".join(_cell(k, row["row"][k]) for k in sorted(row["row"], key=lambda k: k != "system")
                         if k in shown or k == "system")
        for measure, by_arm in row["values"].items():
            entry = {"row": row["row"], "label": label, "measure": measure,
                     "higher_is_better": bool(_RATE.search(measure)), "arms": {}}
            for arm in arms:
                values = by_arm.get(arm, {})
                ratios = [values[p] / by_arm[base][p] for p in sorted(values)
                          if p in by_arm.get(base, {}) and by_arm[base][p]]
                entry["arms"][arm] = {
                    "values": [values[p] for p in sorted(values)],
                    "median": statistics.median(values.values()) if values else None,
                    "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None}
            out.append(entry)
    return out


def _cell(k: str, v) -> str:
    if k == "system":
        return str(v)
    if k in ("bytes", "table_bytes") and isinstance(v, int):
        from aggnet.client.config import format_size
        return format_size(v)
    return f"{k}={v}"


def is_peer(row: dict) -> bool:
    """Whether a row is one of the peers aggnet is measured beside (the same code under every arm)."""
    system = str(row.get("system", row.get("transport", "")))
    return any(p in system for p in ("gloo", "memcpy", "floor", "raw"))


def _print(pairs: list[dict], arms: list[str]) -> None:
    def spread(rs):
        return f"{statistics.median(rs):.3f} [{min(rs):.3f}-{max(rs):.3f}]" if rs else "-"

    by_measure: dict[str, list[dict]] = {}
    for p in pairs:
        by_measure.setdefault(p["measure"], []).append(p)
    for measure, entries in by_measure.items():
        # times in seconds print as ms; a rate (GB/s) is not a time
        seconds = measure.endswith("_s") and not measure.endswith("_per_s")
        better = "higher is better" if entries[0]["higher_is_better"] else "lower is better"
        print(f"\n{measure}{' in ms' if seconds else ''} ({better}): each arm's median over the runs, then each "
              f"arm over {arms[0]}, pair by pair: median [min-max]")
        for e in entries:
            cells = [f"{a} {_num(e['arms'][a]['median'], 1e3 if seconds else 1)}" for a in arms]
            ratios = [f"{a}/{arms[0]} {spread(e['arms'][a]['ratios'])}" for a in arms[1:]]
            peer = "  (a peer: the machine's noise)" if is_peer(e["row"]) else ""
            print(f"  {e['label']}: {'  '.join(cells)}  {'  '.join(ratios)}{peer}")


def _num(x, scale: float = 1) -> str:
    return "-" if x is None else f"{x * scale:.4g}"


def _run_once(arm: Arm, command: list[str], out: Path, timeout: float, log: Path) -> list[dict]:
    argv = [sys.executable, "-m", "aggnet", *command, "--json", str(out)]
    with open(log, "w") as f:
        try:
            got = subprocess.run(argv, env=_environment(arm), stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CompareError(f"arm {arm.name}: `aggnet {' '.join(command)}` ran past --timeout {timeout:g}s; its "
                               f"output is in {log}") from None
    if got.returncode != 0:
        lines = log.read_text(errors="replace").strip().splitlines()
        raise CompareError(f"arm {arm.name}: `aggnet {' '.join(command)}` exited {got.returncode}: "
                           f"{lines[-1] if lines else 'no output'} (its output is in {log})")
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError) as exc:
        raise CompareError(f"arm {arm.name}: `aggnet {command[0]}` wrote no JSON records to {out}: {exc}") from None
    records = data.get("records") if isinstance(data, dict) else data
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise CompareError(f"arm {arm.name}: `aggnet {command[0]}`'s JSON holds no list of records to pair")
    return records


def compare(arms: list[Arm], command: list[str], pairs: int, timeout: float, work: Path) -> dict:
    """Run ``command`` ``pairs`` times under every arm, alternated; every
    run's records, and the paired ratios."""
    runs = []
    with Progress("aggnet compare", pairs * len(arms)) as progress:
        for pair in range(pairs):
            k = pair % len(arms)
            for arm in arms[k:] + arms[:k]:
                stem = work / f"{arm.name}-{pair + 1}"
                t0 = time.monotonic()
                records = _run_once(arm, command, stem.with_suffix(".json"), timeout, stem.with_suffix(".log"))
                took = time.monotonic() - t0
                runs.append({"arm": arm.name, "pair": pair + 1, "seconds": took, "records": records})
                progress.step(f"pair {pair + 1}, {arm.name}: {took:.0f}s")
    names = [a.name for a in arms]
    return {"command": ["aggnet", *command], "arms": [{"name": a.name, "rev": a.rev, "env": a.env, "code": a.code}
                                                      for a in arms],
            "pairs": pairs, "runs": runs, "paired": pair_records(runs, names)}


def _busy() -> str | None:
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    cores = os.cpu_count() or 1
    return (f"the machine is busy (load {load:.1f} on {cores} cores): the ratios will be noisy; compare on a quiet "
            f"machine" if load > 0.5 * cores else None)


def main(args) -> int:
    command = list(args.command)
    try:
        if len(args.arm) < 2:
            raise CompareError("name at least two arms to compare (--arm before@HEAD~1 --arm after, or "
                               "--arm off:AGGNET_PREDICT_SCALE=0 --arm on:AGGNET_PREDICT_SCALE=1)")
        if command[0] not in COMMANDS:
            raise CompareError(f"aggnet compare pairs the records of {', '.join(COMMANDS)}; got {command[0]!r} "
                               f"(aggnet compare --arm A --arm B -- bench ...)")
        if any(a == "--json" or a.startswith("--json=") for a in command):
            raise CompareError("leave --json out of the command: aggnet compare gives each run its own file "
                               "(its own --json, before '--', writes them all)")
        arms = [parse_arm(s) for s in args.arm]
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            raise CompareError(f"arm names must differ: {', '.join(names)}")
    except CompareError as exc:
        print(f"aggnet compare: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="aggnet-compare-"))
    keep = False
    try:
        for arm in arms:
            if arm.rev:
                arm.tree = export(arm.rev, work / "trees")
            arm.code = _where_from(arm)
            print(f"arm {arm.describe()}: aggnet from {arm.code}")
        busy = _busy()
        if busy:
            print(f"aggnet compare: {busy}", file=sys.stderr)
        result = compare(arms, command, args.pairs, args.timeout, work)
    except CompareError as exc:
        keep = True
        print(f"aggnet compare: {exc}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    result["system_info"] = {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
                             "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _print(result["paired"], [a.name for a in arms])
    print(f"\n{args.pairs} pairs; the order of the arms rotated from pair to pair")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {len(result['runs'])} runs and {len(result['paired'])} paired rows to {args.json}")
    return 0
