"""The house's layers (docs/design.md, "Modules"): no import circle in kvtierd/, and imports point
down — the store imports no face. Every import counts, those under ``TYPE_CHECKING`` and inside
functions too: a circle hidden from the interpreter is still two modules that cannot be read
(or moved) apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvtierd"
# What talks to the world — sockets, connections and the liveness of their peers, the requests'
# handlers, processes (the tier companion and the daemon's side of it), HTTP, the command line —
# and the tools built on it: the store never imports these. The store knows the second tier by
# its interface alone (kvtierd.tiering.interface).
FACES = {"kvtierd.server", "kvtierd.handlers", "kvtierd.sessions", "kvtierd.peers", "kvtierd.daemon", "kvtierd.cli",
         "kvtierd.metrics", "kvtierd.systemd", "kvtierd.offline", "kvtierd.__main__"}
FACE_PACKAGES = ("kvtierd.tier", "kvtierd.tiering")
STORE_SIDE = {"kvtierd.tiering.interface"}


def is_face(name: str) -> bool:
    return name in FACES or (name.startswith(FACE_PACKAGES) and name not in STORE_SIDE)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """kvtierd module → the kvtierd modules it imports (a package's import of its own submodules
    counts; the implicit import of a module's parent packages does not)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_daemon():
    assert circles(imports()) == []


def test_the_store_imports_no_face():
    graph = imports()
    for name, found in graph.items():
        if not is_face(name):
            faces = sorted(filter(is_face, found))
            assert not faces, f"{name} imports {faces}"


def test_the_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
