"""Operator-supplied regular expressions (lane rules, shaping rules) that run on text a
client or an upstream controls: refuse the shapes that backtrack super-linearly.

Rules:
- A repetition of unbounded count (`*`, `+`, `{n,}`) that contains another unbounded
  repetition (`(a+)+`, `(\\w*\\s?)*`) is refused at config load, naming the pattern: such a
  pattern can take exponential time on a crafted header or reply (the classic ReDoS shape).
- Alternatives under an unbounded repetition (`(a|a)*`) are refused for the same reason.
- Text given to those patterns is also capped (`MAX_SUBJECT`): a bounded pattern on a
  bounded string has a bounded cost whatever the input.
- Python's own parser (`re._parser`) gives the tree; where it is missing the check is
  skipped (the cap still holds).
"""

from __future__ import annotations

import importlib
from typing import Any

MAX_SUBJECT = 2000  # characters of a header value or reply text a configured pattern sees

_sre: Any
try:  # Python 3.11+ (our minimum) has the parser at re._parser
    _sre = importlib.import_module("re._parser")
except ImportError:  # pragma: no cover
    _sre = None


def check_linear(pattern: str) -> None:
    """Raise ValueError when `pattern` nests unbounded repetitions."""
    if _sre is None:  # pragma: no cover
        return
    tree = _sre.parse(pattern)
    if _nested(list(tree), inside=False):
        raise ValueError(
            f"regular expression {pattern!r} nests repetitions (like '(a+)+'); it could take "
            "exponential time on hostile input: rewrite it without the nesting"
        )


def _unbounded(av: Any) -> bool:
    return bool(av[1] == _sre.MAXREPEAT or av[1] > 10)


def _nested(items: list[Any], inside: bool) -> bool:
    for op, av in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            unbounded = _unbounded(av) and name != "POSSESSIVE_REPEAT"
            if unbounded and inside:
                return True
            body = list(av[2])
            if unbounded and any(str(o) == "BRANCH" for o, _ in _flatten(body)):
                return True
            if _nested(body, inside or unbounded):
                return True
        elif name == "SUBPATTERN":
            if _nested(list(av[3]), inside):
                return True
        elif name == "BRANCH":
            if any(_nested(list(branch), inside) for branch in av[1]):
                return True
        elif name in ("ASSERT", "ASSERT_NOT"):
            if _nested(list(av[1]), inside):
                return True
        elif name == "ATOMIC_GROUP" and _nested(list(av), False):
            return True
    return False


def _flatten(items: list[Any]) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    for op, av in items:
        out.append((op, av))
        if str(op) == "SUBPATTERN":
            out.extend(_flatten(list(av[3])))
    return out


def bounded(text: str) -> str:
    return text if len(text) <= MAX_SUBJECT else text[:MAX_SUBJECT]
