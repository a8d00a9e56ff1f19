"""The documentation: nothing the README said is lost, the generated reference and man pages
match the code, everything the code has is explained, and the built site's links hold."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relay.cli import docsgen
from tests import doccheck

ROOT = Path(__file__).resolve().parents[1]
HEADINGS = ROOT / "tests" / "data" / "readme_headings_b281b99.txt"


def _headings(text: str) -> set[str]:
    """Markdown ATX headings outside fenced code blocks, as their text."""
    out, fence = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        m = re.match(r"#{1,6} (.+?)\s*#*\s*$", line)
        if m and not fence:
            out.add(m[1].strip())
    return out


def _doc_headings() -> set[str]:
    found = _headings((ROOT / "README.md").read_text(encoding="utf-8"))
    for md in (ROOT / "docs").rglob("*.md"):
        found |= _headings(md.read_text(encoding="utf-8"))
    return found


def test_every_heading_of_the_old_readme_is_a_heading_somewhere() -> None:
    wanted = [
        line.split(" ", 1)[1].strip()
        for line in HEADINGS.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    assert len(wanted) > 50  # the list is the README's, not an empty file
    missing = [h for h in wanted if h not in _doc_headings()]
    assert missing == []


def test_the_heading_list_is_the_readme_of_b281b99() -> None:
    git = shutil.which("git")
    probe = subprocess.run(
        [git or "git", "-C", str(ROOT), "cat-file", "-e", "b281b99:README.md"],
        capture_output=True,
    )
    if git is None or probe.returncode != 0:
        pytest.skip("no git history here (an unpacked release): the stored list stands")
    old = subprocess.run(
        ["git", "-C", str(ROOT), "show", "b281b99:README.md"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    fence, heads = False, []
    for line in old.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith(("## ", "### ")):
            heads.append(line)
    assert HEADINGS.read_text(encoding="utf-8").splitlines() == heads


def test_generated_pages_match_the_code() -> None:
    """`make docs` was run after the last change to config, CLI, metrics, events, replies."""
    stale = [
        rel
        for rel, text in docsgen.render_all().items()
        if not (ROOT / rel).exists() or (ROOT / rel).read_text(encoding="utf-8") != text
    ]
    assert stale == [], "run `make docs` (python -m relay.cli.docsgen) and commit the result"


def test_docsgen_check_mode_fails_on_a_stale_page(tmp_path: Path) -> None:
    # a copy of the repository's generated files, one of them edited by hand
    for rel in docsgen.render_all():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    out = ["--out", str(tmp_path)]
    assert docsgen.main(["--check", *out]) == 0
    page = tmp_path / "docs/reference/metrics.md"
    page.write_text(page.read_text(encoding="utf-8") + "edited\n", encoding="utf-8")
    assert docsgen.main(["--check", *out]) == 1
    assert docsgen.main(out) == 0  # regenerates it
    assert docsgen.main(["--check", *out]) == 0
    assert page.read_text(encoding="utf-8") == (ROOT / "docs/reference/metrics.md").read_text(
        encoding="utf-8"
    )


def docsgen_meanings() -> dict[str, Any]:
    return docsgen.load_meanings(ROOT)


def _without(section: str, key: str) -> dict[str, Any]:
    m = docsgen_meanings()
    m[section] = {k: v for k, v in m[section].items() if k != key}
    return m


def test_a_config_key_without_a_meaning_fails() -> None:
    with pytest.raises(docsgen.MissingMeaning, match=r"spool\.retention"):
        docsgen.config_rows(_without("config", "spool.retention"))


def test_a_null_default_without_a_type_fails() -> None:
    with pytest.raises(docsgen.MissingMeaning, match=r"dsn\.from"):
        docsgen.config_rows(_without("config_types", "dsn.from"))


def test_a_log_event_without_a_meaning_fails() -> None:
    with pytest.raises(docsgen.MissingMeaning, match="dead_letter"):
        docsgen.log_events(_without("events", "dead_letter"))


def test_a_sendmail_option_without_a_meaning_fails() -> None:
    with pytest.raises(docsgen.MissingMeaning, match="-t"):
        docsgen.sendmail_options(_without("sendmail_options", "-t"))


def test_a_metric_without_help_fails(monkeypatch: Any) -> None:
    from prometheus_client import Counter

    from relay.ops import metrics

    real = metrics.Metrics.__init__

    def with_undocumented(self: Any) -> None:
        real(self)
        self.extra = Counter("relay_undocumented", "", registry=self.registry)

    monkeypatch.setattr(metrics.Metrics, "__init__", with_undocumented)
    with pytest.raises(docsgen.MissingMeaning, match="relay_undocumented_total"):
        docsgen.metrics()


def test_every_config_key_of_the_code_is_in_the_reference() -> None:
    from relay.config.tree import DEFAULTS

    page = (ROOT / "docs/reference/config.md").read_text(encoding="utf-8")
    for key in DEFAULTS:
        assert f"| `{key}" in page
    rows = docsgen.config_rows(docsgen_meanings())
    assert {"spool.path", "destinations.<name>.rate", "listen[].address"} <= {r.key for r in rows}
    by_key = {r.key: r for r in rows}
    assert (by_key["spool.inline_max"].type, by_key["spool.inline_max"].default) == (
        "size",
        "128KiB",
    )
    assert by_key["retry.max_age"].type == "duration"
    assert by_key["destinations.<name>.daily_limit"].type == "integer"  # null default


def test_no_meaning_names_what_the_code_no_longer_has() -> None:
    m = docsgen_meanings()
    assert docsgen.stale_config_meanings(m) == []
    assert docsgen.stale_event_meanings(m, docsgen.log_events(m)) == []


def test_a_meaning_for_a_key_the_config_does_not_have_is_stale() -> None:
    m = docsgen_meanings()
    m["config_extra"] = {**m["config_extra"], "spool.colour": ["string", "no such key"]}
    m["config"] = {**m["config"], "limits.max_smiles": "no such key either"}
    assert docsgen.stale_config_meanings(m) == ["limits.max_smiles", "spool.colour"]
    # the schema's paths, in the reference's notation
    assert {"listen[].tls.mode", "destinations.<name>.rate", "outbox.batch"} <= (
        docsgen.schema_keys()
    )


def test_every_log_event_is_in_the_reference() -> None:
    from relay.ops.logs import EVENTS

    names = {r.name for r in docsgen.log_events(docsgen_meanings())}
    assert set(EVENTS) <= names
    # events logged outside logs.EVENTS are found in the code too
    assert {"circuit_open", "upstream_config_error", "health_resolved", "failover"} <= names


def test_every_metric_is_in_the_reference() -> None:
    from relay.ops.metrics import Metrics

    m = Metrics()
    exposed = {fam.name for fam in m.registry.collect()}
    names = {r.name.removesuffix("_total") for r in docsgen.metrics()}
    assert exposed == names


def test_replies_table_has_what_clients_are_told() -> None:
    rows = docsgen.smtp_replies()
    text = {f"{r.code} {r.text}" for r in rows}
    # the replies CONTRACT.md fixes (their texts may change, their codes may not)
    for fixed in ("451 4.3.0 ", "452 4.3.1 ", "554 5.7.1 "):
        assert any(t.startswith(fixed) and len(t) > len(fixed) for t in text), fixed
    assert all(re.fullmatch(r"[245]\d\d", r.code) for r in rows)
    # the samples of upstream replies that relay/delivery/upstream_ids.py recognises are not ours
    assert not any("relay/delivery/upstream_ids.py" in r.files for r in rows)


def test_every_command_and_option_has_help_text() -> None:
    cmds = docsgen.commands()
    assert {"serve", "queue list", "suppression remove", "destination reset"} <= {
        c.name for c in cmds
    }
    assert docsgen.check_commands(cmds) == []


def test_help_of_every_command_prints(capsys: Any) -> None:
    from relay.cli.main import _parser

    for c in [None, *docsgen.commands()]:
        argv = ([] if c is None else c.name.split()) + ["--help"]
        with pytest.raises(SystemExit) as e:
            _parser().parse_args(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: relay")
        if c is not None:  # `relay <verb> --help` says what the verb does
            assert " ".join(c.help.split()) in " ".join(out.split())


def test_a_command_without_help_is_reported() -> None:
    bare = docsgen.Command("frob", "relay frob THING", "frob things", (("THING", ""),), ("thing",))
    assert docsgen.check_commands([bare]) == ["relay frob thing"]
    nohelp = docsgen.Command("frob", "relay frob", "", (), ())
    assert docsgen.check_commands([nohelp]) == ["relay frob"]


def _groff() -> str:
    groff = shutil.which("groff")
    if groff is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "groff-base", "man-db"],
            capture_output=True,
            timeout=300,
        )
        groff = shutil.which("groff")
    if groff is None:
        pytest.skip("groff is not installed and could not be installed")
    return groff


@pytest.mark.parametrize("page", ["relay.8", "relay-sendmail.1", "mailq.1", "relay.yaml.5"])
def test_man_page_renders_without_warnings(page: str) -> None:
    groff = _groff()
    path = ROOT / "man" / page
    r = subprocess.run(
        [groff, "-man", "-Tutf8", "-ww", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )
    assert r.returncode == 0
    assert r.stderr == ""
    text = re.sub(".\x08", "", r.stdout)  # grotty's overstrike bold and underline
    assert "NAME" in text and "SEE ALSO" in text
    name = page.rsplit(".", 1)[0]
    assert name in text


def test_relay_8_lists_every_command() -> None:
    text = (ROOT / "man" / "relay.8").read_text(encoding="utf-8")
    for c in docsgen.commands():
        assert f".B relay {c.name.replace('-', chr(92) + '-')}" in text


def test_readme_links_reach_files() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) > 10
    missing = [t for t in links if "://" not in t and not (ROOT / t).exists()]
    assert missing == []
    assert len(readme.splitlines()) <= 300


def test_site_builds_strict_and_every_link_and_anchor_resolves(tmp_path: Path) -> None:
    site = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr
    assert (site / "reference" / "config.html").exists()
    assert doccheck.check(site) == []


def test_the_link_checker_finds_a_missing_anchor_and_page(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text(
        '<h2 id="here">x</h2><a href="#here">ok</a><a href="b.html#there">ok</a>'
        '<a href="b.html#gone">broken</a><a href="c.html">missing</a>'
        '<a href="https://example.com/#x">external</a>',
        encoding="utf-8",
    )
    (tmp_path / "b.html").write_text('<p id="there">y</p>', encoding="utf-8")
    assert doccheck.check(tmp_path) == [
        "a.html: b.html#gone (no anchor #gone)",
        "a.html: c.html (no such file)",
    ]
