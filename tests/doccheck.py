"""Check a built docs site: every internal link reaches a page, every #fragment an anchor.

`python -m tests.doccheck site` (run by `make docs`; tests/test_docs.py calls `check`).
MkDocs' own validation catches most broken links in Markdown; this reads the HTML it wrote,
so it also sees links inside tables, included files and the theme's navigation.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# links into the search index, the theme's assets and the like need not be pages
_SKIP_PREFIXES = ("assets/", "search/")


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            if tag == "a" and name == "href":
                self.links.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def check(site: Path) -> list[str]:
    """Every broken internal link of the site, as `page: href (why)`."""
    site = site.resolve()
    pages = {p: _parse(p) for p in sorted(site.rglob("*.html"))}
    problems = []
    for path, page in pages.items():
        rel = path.relative_to(site)
        if str(rel) == "404.html":
            continue  # the theme's not-found page links from the site root, by design
        for href in page.links:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("mailto:"):
                continue  # external: not checked (the build is offline)
            if parts.path:
                target = (path.parent / unquote(parts.path)).resolve()
                if target.is_dir():
                    target = target / "index.html"
            else:
                target = path
            try:
                target_rel = target.relative_to(site)
            except ValueError:
                problems.append(f"{rel}: {href} (outside the site)")
                continue
            if str(target_rel).startswith(_SKIP_PREFIXES) and not parts.fragment:
                continue
            if not target.exists():
                problems.append(f"{rel}: {href} (no such file)")
                continue
            frag = unquote(parts.fragment)
            if not frag or target.suffix != ".html":
                continue
            ids = pages[target].ids if target in pages else _parse(target).ids
            if frag not in ids:
                problems.append(f"{rel}: {href} (no anchor #{frag})")
    return problems


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "site")
    if not (site / "index.html").exists():
        print(f"doccheck: {site}/index.html missing: build the site first", file=sys.stderr)
        return 2
    problems = check(site)
    for p in problems:
        print(f"doccheck: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
