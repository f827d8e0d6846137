"""What a process in a network namespace sees (``python -m harness.ns_probe
NAME CODE``): printed as one JSON line, then read a line from stdin and
exit with CODE; the namespace tests run it both forked and under ``ip
netns exec`` and compare."""

from __future__ import annotations

import json
import os
import socket
import sys


def main() -> int:
    name, code = sys.argv[1], int(sys.argv[2])
    seen = {"interfaces": sorted(n for _, n in socket.if_nameindex()),
            "sys_class_net": sorted(os.listdir("/sys/class/net")),
            "hosts_name": socket.gethostbyname(name),
            "env": os.environ.get("AGGNET_PROBE"), "cwd": os.getcwd(), "argv": sys.argv[1:],
            "main": __name__}
    print(json.dumps(seen), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    seen_line = sys.stdin.readline().strip()
    print(json.dumps({"stdin": seen_line}))
    return code


if __name__ == "__main__":
    sys.exit(main())
