"""HTML for the console (pure): one escaping helper, a few builders, the layout templates,
and the charts (inline SVG drawn here: no script library, nothing from elsewhere).

Rule: everything from the spool, the config or the request goes through `h` (or a builder
that calls it); templates (string.Template) take only strings built here.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from string import Template
from typing import Any
from urllib.parse import urlencode

NAV = (
    ("", "Overview"),
    ("queue", "Queue"),
    ("destinations", "Destinations"),
    ("suppressions", "Suppressions"),
    ("dead", "Dead letters"),
    ("alerts", "Alerts"),
    ("feedback", "Feedback"),
)


class Raw(str):
    """Markup built here (a constant): `table` heads take it as it is."""


def h(value: Any) -> str:
    """Text made safe for HTML content and quoted attributes."""
    return html.escape("" if value is None else str(value), quote=True)


def template(name: str) -> Template:
    text = resources.files(__package__).joinpath("templates", name).read_text("utf-8")
    return Template(text)


def static(name: str) -> bytes | None:
    if name not in ("console.js", "console.css"):
        return None
    return resources.files(__package__).joinpath("static", name).read_bytes()


def url(path: str, **query: Any) -> str:
    q = {k: v for k, v in query.items() if v not in (None, "")}
    return f"/console/{path}" + (f"?{urlencode(q)}" if q else "")


def link(href: str, text: Any) -> str:
    return f'<a href="{h(href)}">{h(text)}</a>'


def status(s: str) -> str:
    cls = s if s in ("ok", "warning", "critical") else "warning"
    return f'<span class="status {cls}">{h(s)}</span>'


def table(head: Sequence[str], rows: Iterable[Sequence[str]], num: Iterable[int] = ()) -> str:
    """A table; cells are HTML already (built with `h`)."""
    nums = set(num)

    def cls(i: int) -> str:
        return ' class="num"' if i in nums else ""

    out = ["<table><thead><tr>"]
    out += [f"<th{cls(i)}>{c if isinstance(c, Raw) else h(c)}</th>" for i, c in enumerate(head)]
    out.append("</tr></thead><tbody>")
    n = 0
    for row in rows:
        n += 1
        out.append("<tr>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row)) + "</tr>")
    if n == 0:
        out.append(f'<tr><td colspan="{len(head)}" class="muted">nothing here</td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


def hidden(name: str, value: Any) -> str:
    return f'<input type="hidden" name="{h(name)}" value="{h(value)}">'


def post_form(action: str, csrf: str, fields: Mapping[str, Any], button: str, cls: str = "") -> str:
    inner = hidden("csrf", csrf) + "".join(hidden(k, v) for k, v in fields.items())
    c = f' class="{h(cls)}"' if cls else ""
    return (
        f'<form method="post" action="{h(action)}" class="inline">{inner}'
        f'<button{c} type="submit">{h(button)}</button></form>'
    )


def nav(current: str) -> str:
    out = []
    for p, t in NAV:
        cur = ' class="current"' if p == current else ""
        out.append(f'<a href="/console/{p}"{cur}>{h(t)}</a>')
    return "".join(out)


def page(title: str, body: str, *, current: str, who: str, refresh: int = 0) -> bytes:
    return (
        template("layout.html")
        .substitute(title=h(title), nav=nav(current), who=who, body=body, refresh=str(refresh))
        .encode()
    )


def login_page(message: str = "") -> bytes:
    msg = f'<p class="banner error">{h(message)}</p>' if message else ""
    return template("login.html").substitute(message=msg).encode()


# --- charts ------------------------------------------------------------------------------------


def chart(
    title: str,
    xs: Sequence[int],
    series: Mapping[str, Sequence[float | None]],
    *,
    unit: str = "",
    width: int = 460,
    height: int = 190,
) -> str:
    """A line chart as inline SVG: one polyline per series (classes s0.. colour them), the
    x axis in minutes (`xs`, unix minutes), a y grid of 4 lines from 0 to the maximum."""
    left, right, top, bottom = 40, 8, 8, 20
    w, hgt = width - left - right, height - top - bottom
    values = [v for vs in series.values() for v in vs if v is not None]
    top_v = max(values, default=0.0)
    ymax = _nice(top_v) if top_v > 0 else 1.0
    x0, x1 = (xs[0], xs[-1]) if xs else (0, 1)
    span = max(1, x1 - x0)
    out = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{h(title)}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i in range(5):
        y = top + hgt - hgt * i / 4
        out.append(f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{left + w}" y2="{y:.1f}"/>')
        out.append(
            f'<text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end">{h(_fmt(ymax * i / 4))}</text>'
        )
    if xs:
        for frac, anchor in ((0.0, "start"), (1.0, "end")):
            m = x0 + span * frac
            label = _hhmm(m)
            out.append(
                f'<text x="{left + w * frac:.1f}" y="{height - 4}" text-anchor="{anchor}">'
                f"{h(label)}</text>"
            )
    for i, (name, vs) in enumerate(series.items()):
        pts = [
            f"{left + w * (x - x0) / span:.1f},{top + hgt - hgt * (v / ymax):.1f}"
            for x, v in zip(xs, vs, strict=False)
            if v is not None
        ]
        if pts:
            top_of = max((v for v in vs if v is not None), default=0.0)
            total = sum(v for v in vs if v is not None)
            out.append(
                f'<polyline class="s{i % 5}" data-series="{h(name)}" data-max="{top_of:g}"'
                f' data-sum="{total:g}" points="{" ".join(pts)}"/>'
            )
    out.append("</svg>")
    legend = "".join(f'<span class="s{i % 5}">{h(n)}</span>' for i, n in enumerate(series))
    suffix = f" ({h(unit)})" if unit else ""
    return (
        f'<div class="card chart-card"><h2>{h(title)}{suffix}</h2>{"".join(out)}'
        f'<div class="legend">{legend}</div></div>'
    )


def _nice(v: float) -> float:
    """The next round number at or above v (1, 2, 5 x 10^n)."""
    exp = math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        if m * 10**exp >= v:
            return float(m * 10**exp)
    return float(10 ** (exp + 1))


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}" if v >= 1 or v == 0 else f"{v:.2g}"


def _hhmm(minute: float) -> str:
    m = int(minute) % (24 * 60)
    return f"{m // 60:02d}:{m % 60:02d} UTC"
