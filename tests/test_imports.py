"""The import graph of relay/ (tests/importgraph.py): no cycle, no arrow up a layer, package
__init__ files that import nothing. `python -m tests.importgraph` shows the graph's layers,
cycles and upward arrows; `--edges` the whole graph."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import importgraph as ig


def test_no_import_cycles() -> None:
    g = ig.graph()
    found = [c for c in ig.cycles(g) if not ig.is_known(c)]
    assert not found, "import cycles in relay/ (python -m tests.importgraph):\n" + "\n".join(
        f"- {' -> '.join(ig.cycle_path(g, c))} (members: {', '.join(c)})" for c in found
    )


def test_known_cycles_are_still_there() -> None:
    """A KNOWN_CYCLES entry that names no cycle any more is dropped, so that none comes back
    under its cover."""
    found = ig.cycles(ig.graph())
    stale = [sorted(k) for k in ig.KNOWN_CYCLES if not any(set(c) <= k for c in found)]
    assert not stale, f"no cycle left among {stale}: drop it from KNOWN_CYCLES"


def test_no_upward_imports() -> None:
    up = ig.upward(ig.graph())
    assert not up, "imports that point up a layer (tests/importgraph.py LAYERS):\n" + "\n".join(
        f"- {a} ({ig.LAYERS[ig.layer_of(a)][0]}) -> {b} ({ig.LAYERS[ig.layer_of(b)][0]})"
        for a, b in up
    )


def test_package_inits_are_docstrings() -> None:
    assert ig.package_imports() == []


def test_every_module_has_a_layer() -> None:
    for name in ig.graph():
        ig.layer_of(name)  # LookupError names a module no prefix of LAYERS covers


# --- the checker itself, on a tree of its own -------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "relay"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return root


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a.py": "from relay import b\n",
            "b.py": "def f():\n    from relay.a import thing\n",
        },
    )
    g = ig.graph(root)
    assert ig.cycles(g) == [["relay.a", "relay.b"]]
    assert ig.cycle_path(g, ["relay.a", "relay.b"]) == ["relay.a", "relay.b", "relay.a"]


def test_a_cycle_through_a_type_checking_import_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "a.py": "import relay.b\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import relay.a\n",
        },
    )
    assert ig.cycles(ig.graph(root)) == [["relay.a", "relay.b"]]


def test_a_package_init_that_imports_its_module_is_a_cycle(tmp_path: Path) -> None:
    """relay/p/__init__.py re-exports relay.p.m, and relay.p.m imports relay.p.n: importing
    relay.p.n runs relay/p/__init__.py, which imports m again."""
    root = _tree(
        tmp_path,
        {
            "p/m.py": "from relay.p.n import x\n",
            "p/n.py": "x = 1\n",
        },
    )
    (root / "p" / "__init__.py").write_text("from relay.p.m import x\n")
    g = ig.graph(root)
    assert ig.cycles(g) == [["relay.p", "relay.p.m"]]
    assert ig.package_imports(root) == ["relay/p/__init__.py"]


def test_relative_imports_resolve(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "p/m.py": "from . import n\nfrom ..q import r\n",
            "p/n.py": "",
            "q/r.py": "",
        },
    )
    assert ig.graph(root)["relay.p.m"] == {"relay", "relay.p", "relay.p.n", "relay.q", "relay.q.r"}


def test_an_import_up_a_layer_is_found() -> None:
    g = {"relay.config.tree": {"relay.spool.writer", "relay.spool", "relay.mail.address"}}
    assert ig.upward(g) == [("relay.config.tree", "relay.spool.writer")]
    g = {"relay.spool.writer": {"relay.config.tree"}}
    assert ig.upward(g) == []


def test_a_module_in_no_layer_is_named() -> None:
    with pytest.raises(LookupError, match=r"relay_extra\.x"):
        ig.layer_of("relay_extra.x")
