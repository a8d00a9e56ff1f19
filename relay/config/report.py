"""How the config's errors are told: `ConfigError` (the CLI exits 78, EX_CONFIG), one line
per error, each starting with its key path, in the order the file is read; pydantic's errors
put in those words (`messages`), with the known key a misspelt one looks like.

Rules:
- A value's problem is a `relay_config` error (relay/config/values.py `problem`) whose text is
  printed as is after the key path; pydantic's own wording never reaches the operator.
- An unknown key names the known key it looks like (`did you mean 'limits'?`); a required key
  left out where such an unknown key stands is reported as that misspelling only.
- A key from the file is shown escaped (a control character must not break the one-error-a-
  line message).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from relay.config import values as types

EX_CONFIG = 78


class ConfigError(Exception):
    """A configuration problem; the message starts with the offending key path."""


SECTION_ORDER = (
    *("config", "hostname", "listen", "spool", "fleet", "outbox", "dedup", "limits", "auth"),
    *("upstream", "upstreams", "routes", "retry", "timeouts", "destinations", "identities"),
    *("shaping", "lanes", "delivery", "alerts", "health", "dsn", "local", "admin", "feedback"),
    *("dkim", "log", "shutdown_timeout", "inbound"),
)


def place(msg: str) -> int:
    """Where an error is listed: its section's place in SECTION_ORDER (unknown keys last)."""
    section = re.split(r"[.\[:]", msg, maxsplit=1)[0]
    return SECTION_ORDER.index(section) if section in SECTION_ORDER else len(SECTION_ORDER)


def messages(e: ValidationError, model: type[BaseModel], prefix: str) -> list[str]:
    """pydantic's errors in the contract's words: `key.path: problem`. A key left out whose
    place an unknown key that looks like it takes is reported as that misspelling."""
    errs = e.errors()
    extras = {
        (err["loc"][:-1], str(err["loc"][-1])) for err in errs if err["type"] == "extra_forbidden"
    }
    misspelt: dict[tuple[Any, ...], str] = {}  # the unknown key's loc -> the key it stands for
    for err in errs:
        *parent, name = err["loc"] or ("",)
        if err["type"] == types.ERROR_TYPE and err["input"] is None and isinstance(name, str):
            others = [x for p, x in extras if p == tuple(parent)]
            close = difflib.get_close_matches(name, others, n=1, cutoff=0.6)
            if close:
                misspelt[(*parent, close[0])] = name
    out = []
    for err in errs:
        loc = err["loc"]
        key = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{shown(p)}" for p in loc)
        key = key.removeprefix(".")  # prefix "": a key at the top of the file
        kind = err["type"]
        ctx = err.get("ctx") or {}
        if kind == types.ERROR_TYPE:
            *parent, name = loc or ("",)
            if any(at[:-1] == tuple(parent) and meant == name for at, meant in misspelt.items()):
                continue  # reported as the misspelling
            if "key" in ctx:
                key = f"{key}.{shown(str(ctx['key']))}"  # a key from the file, escaped
            out.append(ctx["msg"] if ctx.get("full") else f"{key}: {ctx['msg']}")
        elif kind == "extra_forbidden":
            name = str(loc[-1])
            if loc in misspelt:
                out.append(f"{key}: unknown key {name!r} (did you mean {misspelt[loc]!r}?)")
            else:
                at = _model_at(model, loc[:-1])
                hook = getattr(at, "unknown_key", None)  # a section's own wording
                if hook is not None:
                    out.append(f"{key}: {hook(name)}")
                else:
                    out.append(unknown_key(key, name, _fields(at)))
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            out.append(f"{key}: expected a mapping, got {types.kind(err['input'])}")
        else:  # not expected: every relay type words its own errors
            out.append(f"{key}: {err['msg']}")
    return out


def shown(name: str) -> str:
    """A key from the file as an error shows it: escaped, since a control character in an
    unknown key must not break the one-error-a-line message (str.splitlines splits on
    \x1c-\x1e too)."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def _model_at(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The section model at `loc` below `model` (for the keys an unknown key may mean)."""
    for part in loc:
        f = model.model_fields.get(str(part)) if model is not None else None
        if f is None:
            return None
        kinds = [f.annotation, *get_args(f.annotation)]
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    return model


def _fields(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return sorted(f.alias or n for n, f in model.model_fields.items())


def unknown_key(key: str, name: str, known: list[str]) -> str:
    """`key: unknown key 'name'`, with the known key it looks like; a password is never
    inline (README "Secrets")."""
    if name == "password" or name.endswith("_password"):
        return (
            f"{key}: unknown key: secrets are never inline; put"
            " it in a file and name the file with 'password_file'"
        )
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key}: unknown key {name!r}{hint}"


def nul_keys(node: object, key: str = "") -> list[str]:
    """The keys whose value (or name) holds a NUL character."""
    if isinstance(node, str):
        return [key or "config"] if "\x00" in node else []
    out: list[str] = []
    if isinstance(node, Mapping):
        for k, v in node.items():
            sub = f"{key}.{shown(str(k))}" if key else shown(str(k))
            out += nul_keys(k, sub) + nul_keys(v, sub)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += nul_keys(v, f"{key}[{i}]")
    return out


def validate(
    model: type[BaseModel], value: object, where: str, errors: list[str], **context: Any
) -> Any:
    """`model` validated from `value` with `context` (`base`: the config's folder), or None
    with every error appended to `errors` in the contract's words, under the key `where`."""
    try:
        return model.model_validate(value, context=context)
    except ValidationError as e:
        errors.extend(messages(e, model, where))
        return None
