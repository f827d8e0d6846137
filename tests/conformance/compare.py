"""Which of the tests gloo passes do not pass through aggnet: two JUnit
XML files of ``torch_distributed.py`` runs (gloo's, aggnet's).

Exit status 1 when any does, but for those that check what a redirected
run cannot be (below)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

#: tests that assert the group's backend is named "gloo", which a group
#: created as "aggnet" is not, whatever it carries
NAME_CHECKS = {"test_get_backend": "asserts dist.get_backend() == 'gloo'"}


def outcomes(path: str) -> dict[str, str]:
    out = {}
    for case in ET.parse(path).iter("testcase"):
        if case.find("skipped") is not None:
            out[case.get("name")] = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            out[case.get("name")] = "failed"
        else:
            out[case.get("name")] = "passed"
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: compare.py GLOO.xml AGGNET.xml", file=sys.stderr)
        return 2
    gloo, aggnet = (outcomes(p) for p in argv)
    passed = sorted(n for n, s in gloo.items() if s == "passed")
    missing = [n for n in passed if aggnet.get(n) != "passed"]
    print(f"gloo passes {len(passed)} of {len(gloo)} tests here; through aggnet {len(passed) - len(missing)} of them "
          f"pass")
    unexplained = 0
    for name in missing:
        why = NAME_CHECKS.get(name)
        unexplained += why is None
        print(f"  {aggnet.get(name, 'not run')}: {name}" + (f" ({why})" if why else ""))
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
