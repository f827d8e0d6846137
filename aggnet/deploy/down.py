"""``aggnet down TOPOLOGY``: stop what ``aggnet up TOPOLOGY`` started on
this machine and remove the switch jobs it installed.

It acts on the record ``up`` kept, not on the file as it reads now, so it
works after the file was edited or removed; with no record there is
nothing to do, and it says so.
"""

from __future__ import annotations

import os
import sys

from aggnet.deploy import state as up_state


def add_arguments(p) -> None:
    p.add_argument("topology", help="the topology file given to aggnet up")
    p.add_argument("--state-dir", default=None,
                   help="where aggnet up recorded what it started (default: $XDG_RUNTIME_DIR/aggnet or "
                        "/tmp/aggnet-UID)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds an aggregator has to stop after SIGTERM before it is killed (default %(default)g)")


def _state_file(state_dir: str, path: str) -> str | None:
    from aggnet.protocol.topology import TopologyError, load

    try:
        candidate = up_state.state_path(state_dir, load(path).job, path)
        if os.path.exists(candidate):
            return candidate
    except TopologyError:
        pass  # edited or removed since up: find the record by its path alone
    return up_state.find_state(state_dir, path)


def main(args) -> int:
    state_dir = args.state_dir or up_state.default_dir()
    state_file = _state_file(state_dir, args.topology) if os.path.isdir(state_dir) else None
    if state_file is None:
        print(f"aggnet down: nothing to stop: aggnet up started nothing for {args.topology} that is recorded in "
              f"{state_dir}")
        return 0
    try:
        with up_state.locked(state_file):
            state = up_state.load(state_file)
            records, jobs = state["aggregators"], state["switch_jobs"]
            if not records and not jobs:
                print(f"aggnet down: nothing to stop for {args.topology}")
            roles = list(records)
            outcomes = up_state.stop_all([(records[r]["pid"], records[r]["argv"]) for r in roles], args.timeout)
            for role, outcome in zip(roles, outcomes):
                print(f"{role}: {outcome} (pid {records[role]['pid']})")
            if jobs:
                from aggnet.deploy import switches as up_switches

                for role, rec in jobs.items():
                    print(f"{role}: {up_switches.remove(rec)}")
            up_state.remove(state_file)
    except up_state.StateError as exc:
        print(f"aggnet down: {exc}", file=sys.stderr)
        return 2
    return 0
