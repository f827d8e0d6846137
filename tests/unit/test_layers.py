"""The layers of aggnet's house, checked on every import in the tree.

Each package sits in a layer and imports only from its own layer or the
ones below; siblings marked independent never import each other (a worker
client and an aggregator share the protocol, not code). A lazy import
inside a function counts the same as one at the top. docs/architecture.md
draws the same picture."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: where each installed package's sources live in the repository
SOURCES = {"aggnet": "aggnet", "aggnet.transport": "transport", "aggnet.hosts": "hosts",
           "aggnet.emulation": "emulation", "aggnet.p4": "p4"}

#: bottom first; within a layer, a tuple of independent siblings (no
#: imports between them) or a set of siblings that may import each other
LAYERS: list[tuple[str, ...] | set[str]] = [
    ("aggnet.protocol",),
    ("aggnet.errors", "aggnet.buffers", "aggnet.metrics", "aggnet.progress", "aggnet.pids"),
    ("aggnet.transport", "aggnet.kernels", "aggnet.processes"),
    ("aggnet.client", "aggnet.hosts", "aggnet.p4"),
    ("aggnet",),  # the public API (aggnet/__init__.py) only: it re-exports the clients
    ("aggnet.pipeline",),  # pipelined stages and weight prediction (the stale-gradient hook predicts too)
    ("aggnet.torch", "aggnet.deploy"),
    ("aggnet.parallel", "aggnet.ray"),  # model-parallel stages; Ray actors and Ray Train, on the torch pieces
    {"aggnet.bench", "aggnet.emulation", "aggnet.sim"},
    {"aggnet.cli", "aggnet.demo", "aggnet.__main__"},
]


def _place(module: str) -> tuple[int, str]:
    """(layer, the sibling the module belongs to)."""
    best = None
    for i, layer in enumerate(LAYERS):
        for top in layer:
            inside = module == top or (top != "aggnet" and module.startswith(top + "."))
            if inside and (best is None or len(top) > len(best[1])):
                best = (i, top)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS in {__file__}")
    return best


def _modules():
    for package, folder in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            name = ".".join([package, *parts])
            if name in SOURCES and name != package:
                continue  # a top-level folder's own package, listed under its folder
            yield name, path


def _imports(name: str, path: Path):
    """(line, imported module) for every aggnet import in the file."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "aggnet":
                    yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "aggnet":
                continue
            for a in node.names:
                # "from aggnet.x import y" may name a module y: count the deepest
                yield node.lineno, f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target


def _is_module(name: str) -> bool:
    for package, folder in sorted(SOURCES.items(), key=lambda kv: -len(kv[0])):
        if name == package or name.startswith(package + "."):
            rest = name[len(package):].lstrip(".").split(".") if name != package else []
            base = ROOT / folder / Path(*rest) if rest else ROOT / folder
            return base.with_suffix(".py").exists() or (base / "__init__.py").exists()
    return False


def _crossings() -> list[str]:
    bad = []
    for name, path in _modules():
        here, mine = _place(name)
        for line, target in _imports(name, path):
            there, theirs = _place(target)
            if theirs == mine:
                continue
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: {name} imports {target}"
            if there > here:
                bad.append(f"{where}, a layer above it ({theirs} over {mine})")
            elif there == here and isinstance(LAYERS[here], tuple):
                bad.append(f"{where}: {mine} and {theirs} are independent siblings")
    return bad


def test_every_import_points_down_the_layers():
    bad = _crossings()
    assert not bad, "imports that cross aggnet's layers:\n" + "\n".join(bad)


def test_the_protocol_imports_nothing_of_aggnet_but_itself():
    for name, path in _modules():
        if name.startswith("aggnet.protocol"):
            others = [t for _, t in _imports(name, path) if not t.startswith("aggnet.protocol")]
            assert not others, f"{name} imports {others}"


@pytest.mark.parametrize("source,target", [
    ("aggnet.client.chunked", "aggnet.hosts.shard"),
    ("aggnet.hosts.shard", "aggnet.client.base"),
    ("aggnet.protocol.wire", "aggnet.transport"),
    ("aggnet.transport.zmq", "aggnet.cli.main"),
])
def test_the_check_sees_a_crossing(source, target, tmp_path, monkeypatch):
    """The checker itself: a planted import across the layers is found."""
    name, path = next((n, p) for n, p in _modules() if n == source)
    planted = tmp_path / path.name
    planted.write_text(path.read_text() + f"\n\ndef _planted():\n    import {target}  # noqa: F401\n")
    monkeypatch.setattr(__import__(__name__), "_modules", lambda: iter([(name, planted)]))
    assert any(target in b for b in _crossings())
