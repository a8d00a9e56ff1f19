"""The base of every section model: unknown keys are errors, values frozen, defaults
validated; and the checks several sections share (secret files, mailboxes, lists)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

from relay.config import values as t

MAX_HEADER_SIZE = 1 << 20
MIN_HEADER_SIZE = 1 << 10


class Section(BaseModel):
    """A config section: unknown keys are errors, values frozen, defaults validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    _hidden: ClassVar[tuple[str, ...]] = ()  # keys relay.yaml does not show

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The section's keys and defaults as written in relay.yaml (by alias)."""
        out = {f.alias or n: f.default for n, f in cls.model_fields.items() if n not in cls._hidden}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def readable(path: Path | None) -> Path | None:
    if path is not None and not os.access(path, os.R_OK):
        raise t.problem(f"cannot read {path}")
    return path


ReadablePath = Annotated[t.OptPath, AfterValidator(readable)]


def list_of(what: str) -> Any:
    def check(value: object) -> object:
        if value is not None and not isinstance(value, list):
            raise t.problem(f"expected a list of {what}" if what else "expected a list")
        return value

    return BeforeValidator(check)


def read_secret(path: Path) -> str:
    """A secret file's contents without the final line break; ValueError (the key's
    problem) when it cannot be read or is empty."""
    try:
        value = path.read_text(encoding="utf-8").strip("\r\n")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    if not value:
        raise ValueError(f"{path} is empty")
    return value


def secret_of(path: Path, key: str) -> str:
    try:
        return read_secret(path)
    except ValueError as e:
        raise t.problem(str(e), key) from None


def mailbox(value: str | None) -> str | None:
    from relay.mail.address import AddressError, check_mailbox

    if value is not None:
        try:
            check_mailbox(value)
        except AddressError as e:
            raise t.problem(f"{value!r}: {e}") from None
    return value


def choice_of(value: object, *choices: str) -> str:
    try:
        return t.choice(value, choices)
    except ValueError as e:
        raise t.problem(str(e)) from None


def required(value: Any) -> Any:
    """For `Annotated[..., AfterValidator(required)] = None`: a key that must be given (a
    misspelling of it is reported as the misspelling, relay/config/report.py)."""
    if value is None:
        raise t.problem("required")
    return value
