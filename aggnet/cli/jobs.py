"""``aggnet job``: the secrets an aggregator shared by many jobs needs.

``create NAME --keys FILE`` adds a job's key to the aggregator's keys file
and prints it for the job's workers (AGGNET_JOB_KEY), refusing a job that
has one unless told ``--replace``; ``show`` prints it again; ``admin`` adds the
key that reads every job's counters; ``curve-keys FILE`` makes the
service's ZeroMQ CURVE key pair and prints the public half for clients
(AGGNET_SERVER_KEY).
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from aggnet.protocol import keys


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="job_command", required=True)
    c = sub.add_parser("create", help="make a job's key (added to the aggregator's keys file)")
    c.add_argument("name", help="the job's name, as its workers give it (job=..., AGGNET_JOB)")
    c.add_argument("--keys", required=True, metavar="FILE", help="the keys file of `aggnet serve --keys`")
    c.add_argument("--replace", action="store_true",
                   help="replace the job's key if it has one (its running workers are then refused)")
    s = sub.add_parser("show", help="print a job's key (for more workers of a job that has one)")
    s.add_argument("name", help="the job's name")
    s.add_argument("--keys", required=True, metavar="FILE", help="the keys file of `aggnet serve --keys`")
    a = sub.add_parser("admin", help="make the admin key (reads every job's counters)")
    a.add_argument("--keys", required=True, metavar="FILE", help="the keys file of `aggnet serve --keys`")
    k = sub.add_parser("curve-keys", help="make the service's CURVE key pair (zmq+tcp encryption)")
    k.add_argument("file", help="where the pair goes (mode 0600; give it to --curve-secret-file)")


def main(args) -> int:
    try:
        if args.job_command == "create":
            key = keys.write_job_key(args.keys, args.name, replace=args.replace)
            print(f"job {args.name!r}: key added to {args.keys}; give the job's workers", file=sys.stderr)
            print(f"export AGGNET_JOB_KEY={shlex.quote(key)}")
        elif args.job_command == "show":
            try:
                with open(args.keys) as f:
                    key = json.load(f).get("jobs", {}).get(args.name)
            except (json.JSONDecodeError, AttributeError):
                key = None
            if key is None:
                print(f"aggnet job: {args.keys} holds no key of job {args.name!r}; make one with "
                      f"`aggnet job create {args.name} --keys {args.keys}`", file=sys.stderr)
                return 1
            print(f"export AGGNET_JOB_KEY={shlex.quote(key)}")
        elif args.job_command == "admin":
            data = {"jobs": {}}
            if os.path.exists(args.keys):
                with open(args.keys) as f:
                    data = json.load(f)
            data["admin"] = keys.new_key()
            fd = os.open(args.keys + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(args.keys + ".tmp", args.keys)
            print(f"admin key added to {args.keys} (aggnet stats --admin-keys {args.keys})", file=sys.stderr)
        else:
            from aggnet.transport.zmq import make_curve_keys

            public = make_curve_keys(args.file)
            print(f"CURVE key pair in {args.file}; serve with --curve-secret-file {args.file}; clients need",
                  file=sys.stderr)
            # Z85 keys hold > # * ? $ and the like: quoted, so a paste into
            # a shell sets the key as made
            print(f"export AGGNET_SERVER_KEY={shlex.quote(public)}")
    except (OSError, ValueError) as exc:
        print(f"aggnet job: {exc}", file=sys.stderr)
        return 1
    return 0
