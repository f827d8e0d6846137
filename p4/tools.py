"""Where the P4 tools live: p4c and BMv2 come from no package registry, so
they are often built from source into a prefix of their own rather than
installed on PATH."""

from __future__ import annotations

import shutil

#: prefixes searched after PATH, the usual targets of a source build
TOOL_DIRS = ("/opt/p4/bin", "/usr/local/bin")


def find_tool(name: str) -> str | None:
    """The path of ``name`` (p4c, simple_switch_grpc, simple_switch_CLI), or None."""
    for candidate in (name, *(f"{d}/{name}" for d in TOOL_DIRS)):
        path = shutil.which(candidate)
        if path:
            return path
    return None
