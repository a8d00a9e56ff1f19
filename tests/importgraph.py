"""The import graph of relay/: its cycles and its arrows that point up a layer.

Rules:
- An edge for every `import` and `from ... import` anywhere in a module: at the top, in a
  function, under `if TYPE_CHECKING:` (a type-only import is still a dependency of the
  design, and the next refactor turns it into a real one).
- Importing `relay.a.b` runs `relay/a/__init__.py` first: an edge to every package on the
  way (so a package `__init__` that imports its own modules is a cycle with each of them;
  keep them docstring-only and import from the modules).
- `from relay.a import b` is an edge to `relay.a` and, when `b` is a module, to `relay.a.b`.
- A cycle is a strongly connected component of more than one module.
- Imports by string (importlib) are not seen: relay/ has one, of the standard library.
- LAYERS: a module may import its own layer and the layers below it, never one above.

`python -m tests.importgraph` prints the layers, every cycle and every upward arrow
(exit 1 when there is any); `--edges` prints the whole graph, one `a -> b` a line.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "relay"

# Bottom first. A module belongs to the layer of the longest prefix that names it. Arrows
# point down (docs/development.md "Import layers"): a module imports its own layer and the
# layers below it, never one above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # what every room uses and that uses nothing of ours: mail syntax, the log formatter
    # and the redaction rules it applies, the fault seams, the shell runner, the metric
    # registry, DKIM keys and signing (the config test-signs with a key it loads)
    (
        "base",
        (
            "relay",  # the package itself: __version__
            "relay.mail",
            "relay.ops.logs",
            "relay.config.redact",
            "relay.ops.faults",
            "relay.ops.shell",
            "relay.ops.tasks",
            "relay.ops.metrics",
            "relay.authenticity.dkim",
        ),
    ),
    # the typed config tree and the value types it is made of: routes and upstreams, lane
    # and shaping rules, users files, the resolver's nameserver syntax; it imports no room
    ("config", ("relay.config",)),
    # formats the rooms share on top of the config's values: a reply's classification, the
    # resolver, OAuth2 tokens, unsubscribe tokens, the AUTH and console users files, long
    # lines; each in the room that uses it
    (
        "formats",
        (
            "relay.delivery.lanes",
            "relay.delivery.shaping",
            "relay.delivery.replies",
            "relay.delivery.errors",
            "relay.delivery.mx",
            "relay.delivery.oauth",
            "relay.authenticity.unsubscribe",
            "relay.inbound.auth",
            "relay.inbound.longlines",
            "relay.ops.console.auth",
        ),
    ),
    # the store: schema, writer, bodies, claims; the alert outbox is a spool table
    ("spool", ("relay.spool", "relay.ops.alerts")),
    # the rooms that do the work, each on the spool and the config; they may use each other
    (
        "rooms",
        (
            "relay.inbound",
            "relay.delivery",
            "relay.feedback",
            "relay.authenticity",
            "relay.ops",
        ),
    ),
    # composition: the daemon, the command line
    ("top", ("relay.daemon", "relay.cli", "relay.__main__")),
)

# Cycles tolerated for now (none: the engine's, the last one, went with its split into
# parts). An entry here is a promise to remove it; test_imports.py fails once it is gone.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


def is_known(comp: Iterable[str]) -> bool:
    return any(set(comp) <= known for known in KNOWN_CYCLES)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module under relay/, by its dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """`name` or its longest prefix that is one of our modules (`relay.x.Class` -> relay.x)."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of relay/ that importing `name` imports directly (and their packages)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        found: list[str] = []
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                parent = ".".join(base + ([node.module] if node.module else []))
            else:
                parent = node.module or ""
            found = [parent] + [f"{parent}.{a.name}" for a in node.names]
        for full in found:
            hit = _known(full, mods)
            if hit is not None:
                targets.update(_with_parents(hit))
    targets.discard(name)
    return targets


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def cycle_path(g: dict[str, set[str]], comp: Iterable[str]) -> list[str]:
    """One closed walk through a component, to show how it closes: a -> b -> ... -> a."""
    members = set(comp)
    start = min(members)
    # breadth-first from start back to start, inside the component
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def layer_of(name: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best < 0:
        raise LookupError(f"{name} is in no layer of tests/importgraph.py LAYERS")
    return best


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Edges from a module to one in a higher layer. An edge to a package is not one:
    importing a module runs its package's __init__, which imports nothing
    (`package_imports`)."""
    names = set(g).union(*g.values())
    packages = {p for name in names for p in _with_parents(name)[:-1]}
    out = []
    for a, targets in sorted(g.items()):
        for b in sorted(targets - packages):
            if layer_of(b) > layer_of(a):
                out.append((a, b))
    return out


def package_imports(root: Path = ROOT) -> list[str]:
    """Package __init__ files that import anything: each must be its docstring alone (an
    import there runs whenever any module of the package is imported)."""
    out = []
    for path in sorted(root.rglob("__init__.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(tree)):
            out.append(str(path.relative_to(root.parent)))
    return out


def main(argv: list[str]) -> int:
    g = graph()
    if "--edges" in argv:
        for a, targets in sorted(g.items()):
            for b in sorted(targets):
                print(f"{a} -> {b}")
        return 0
    print("layers (bottom first; a module imports its own layer and those below):")
    for name, prefixes in LAYERS:
        print(f"  {name}: {', '.join(prefixes)}")
    found = cycles(g)
    print(f"\n{len(g)} modules, {sum(map(len, g.values()))} edges, {len(found)} cycles")
    for comp in found:
        known = is_known(comp)
        note = " (known: being removed, see KNOWN_CYCLES)" if known else ""
        print(f"- cycle of {len(comp)}{note}: {' -> '.join(cycle_path(g, comp))}")
        print(f"  members: {', '.join(comp)}")
    up = upward(g)
    print(f"\n{len(up)} upward imports")
    for a, b in up:
        print(f"- {a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})")
    inits = package_imports()
    print(f"\n{len(inits)} package __init__ files that import")
    for path in inits:
        print(f"- {path}")
    unknown = [c for c in found if not is_known(c)]
    return 1 if unknown or up or inits else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
