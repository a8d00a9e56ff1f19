"""A dead upstream is a warning in minutes (issue 26 item 5): the pure judgement
(`health.destination` with `failing_for`/`answered`) row by row, the breaker that measures
it (`failing_since`, `answered`), the engine's view of it, and the config key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.tree import ConfigError, load_config
from relay.delivery import operator, shaping, views
from relay.ops import health

# name, circuit, failures, config error, failing_for, answered, failing_after -> status, words
ROWS: list[tuple[str, int, str | None, float | None, bool, float, str, str]] = [
    # never failed, or the last attempt worked
    ("closed", 0, None, None, True, 300.0, "ok", "d: ok"),
    ("closed", 0, None, None, False, 300.0, "ok", "d: ok"),  # nothing tried yet
    # failing, but it answered since start and not for failing_after yet: as before
    ("closed", 1, None, 10.0, True, 300.0, "ok", "1 consecutive connection failures"),
    ("closed", 4, None, 299.9, True, 300.0, "ok", "4 consecutive"),
    # every attempt failed for failing_after: a warning, whatever the circuit says
    ("closed", 1, None, 300.0, True, 300.0, "warning", "every attempt has failed for 5m0s"),
    ("closed", 1, None, 3600.0, True, 300.0, "warning", "failed for 1h0m"),
    ("open", 5, None, 400.0, True, 300.0, "warning", "circuit open, 5 consecutive"),
    # never answered since start: a warning at the first failure
    ("closed", 1, None, 0.0, False, 300.0, "warning", "d: has not answered since start"),
    ("closed", 2, None, 299.0, False, 300.0, "warning", "(2 consecutive failures"),
    # and failing long enough: the duration is the news
    ("closed", 3, None, 301.0, False, 300.0, "warning", "every attempt has failed for 5m1s"),
    # a refused configuration stays critical
    ("closed", 1, "h: 535 bad", 900.0, False, 300.0, "critical", "refused our configuration"),
    # the circuit's own warnings stay
    ("open", 5, None, 30.0, True, 300.0, "warning", "circuit open after 5"),
    ("half-open", 5, None, 90.0, True, 300.0, "warning", "circuit half-open"),
]


@pytest.mark.parametrize(
    ("circuit", "failures", "err", "failing_for", "answered", "after", "want", "words"), ROWS
)
def test_destination_judgement(
    circuit: str,
    failures: int,
    err: str | None,
    failing_for: float | None,
    answered: bool,
    after: float,
    want: str,
    words: str,
) -> None:
    status, detail = health.destination(
        "d",
        circuit,
        failures,
        err,
        "2026-01-01T00:00:00Z",
        failing_for=failing_for,
        answered=answered,
        failing_after=after,
    )
    assert (status, words in detail) == (want, True), detail
    assert detail.startswith("d: ")  # the check names the destination


@pytest.mark.parametrize(
    ("mx_mode", "upstream", "err", "shown", "want"),
    [
        (False, True, None, False, True),  # the smarthost
        (True, True, None, False, True),  # a route's upstream in MX mode: ours
        (True, False, None, False, False),  # a recipient domain: its own problem
        (True, False, "535 bad", False, True),  # ... unless it refused our configuration
        (True, False, None, True, True),  # a check once shown stays (to turn ok)
        (False, False, None, False, True),  # a `via: mx` domain in smarthost mode: as before
    ],
)
def test_which_destinations_get_a_check(
    mx_mode: bool, upstream: bool, err: str | None, shown: bool, want: bool
) -> None:
    assert health.judged(mx_mode, upstream, err, shown) is want


def test_the_breaker_remembers_the_first_failure_since_the_last_answer() -> None:
    b = shaping.Breaker(threshold=2, cooldown=60.0)
    assert (b.failing_since, b.answered) == (None, False)
    b.on_failure(100.0)
    b.on_failure(110.0)  # opens the circuit
    b.on_failure(120.0)  # a late failure while open: ignored by the count, not here
    assert (b.failing_since, b.failures, b.answered) == (100.0, 2, False)
    b.on_success(130.0)
    assert (b.failing_since, b.answered, b.state(130.0)) == (None, True, "closed")
    b.on_failure(140.0)
    assert b.failing_since == 140.0
    b.release()  # our own error says nothing about the upstream
    assert b.failing_since == 140.0


class _Metric:
    def labels(self, *_: Any) -> _Metric:
        return self

    def set(self, _: float) -> None:
        pass


class _Engine:
    """What operator.command and views.health read of the engine's destinations."""

    def __init__(self, st: Any, now: float) -> None:
        self.dests = {st.name: st}
        self.now = now
        self.metrics = type("M", (), {"circuit_open": _Metric()})()

    def values(self) -> Any:
        return self.dests.values()

    def clock(self) -> float:
        return self.now

    def dest(self, name: str) -> Any:
        return self.dests[name]

    def retune(self, st: Any) -> None:
        pass

    def breaker_changed(self, st: Any, before: str, now: float, why: str) -> None:
        from relay.delivery.destinations import Destinations

        Destinations.breaker_changed(self, st, before, now, why)  # type: ignore[arg-type]


def _dest(tmp_path: Path, upstream: bool = True) -> Any:
    from relay.config.routes import UpstreamHost
    from relay.delivery.jobs import DestState

    return DestState(
        name="smarthost",
        conf=_load(tmp_path, {}).destination("smarthost"),
        bucket=None,
        adaptive=shaping.Adaptive(base_rate=shaping.UNLIMITED, base_connections=4),
        breaker=shaping.Breaker(threshold=1, cooldown=600.0),
        upstream=UpstreamHost("smarthost", "127.0.0.1", 25, "none") if upstream else None,
    )


def test_the_engine_view_measures_the_failing_time_and_an_operator_reset_keeps_it(
    tmp_path: Path,
) -> None:
    st = _dest(tmp_path)
    e = _Engine(st, 1000.0)
    st.breaker.on_failure(900.0)
    (d,) = views.health(e)  # type: ignore[arg-type]
    assert (d.name, d.circuit, d.failing_for, d.answered, d.upstream) == (
        "smarthost",
        "open",
        100.0,
        False,
        True,
    )
    # `destination reset` closes the circuit, but no answer came: still failing since 900
    operator.command(e, lambda st: None, "reset", "smarthost", 1000.0)  # type: ignore[arg-type]
    (d,) = views.health(e)  # type: ignore[arg-type]
    assert (d.circuit, d.failures, d.failing_for, d.answered) == ("closed", 0, 100.0, False)
    assert not views.health(_Engine(_dest(tmp_path, upstream=False), 0.0))[0].upstream  # type: ignore[arg-type]


def _load(tmp_path: Path, extra: dict[str, Any]) -> Any:
    p = tmp_path / "relay.yaml"
    p.write_text(yaml.safe_dump({"spool": {"path": str(tmp_path / "spool")}, **extra}))
    return load_config(p)


def test_failing_after_defaults_to_five_minutes_and_is_a_duration(tmp_path: Path) -> None:
    assert _load(tmp_path, {}).health.failing_after == 300.0
    assert _load(tmp_path, {"health": {"failing_after": "2s"}}).health.failing_after == 2.0
    with pytest.raises(ConfigError, match=r"health\.failing_after"):
        _load(tmp_path, {"health": {"failing_after": "soon"}})
    shipped = yaml.safe_load((Path(__file__).parents[2] / "conf/relay.yaml").read_text())
    assert shipped["health"]["failing_after"] == "5m"


def test_the_failing_time_is_kept_for_the_next_start_of_a_configured_upstream(
    tmp_path: Path,
) -> None:
    from relay.delivery.engine import Engine
    from relay.spool.writer import SpoolWriter

    cfg = _load(tmp_path, {"upstream": {"smarthost": {"host": "127.0.0.1", "port": 2525}}})
    now = {"t": 5000.0}
    e = Engine(cfg, SpoolWriter(cfg.spool_path), clock=lambda: now["t"]).dests
    e.dest("smarthost").breaker.on_failure(4000.0)
    e.dest("example.org")  # a recipient domain (MX): not an upstream, not kept
    e.dest("example.org").breaker.on_failure(4000.0)
    kept = views.failing_since(e)
    assert kept == {"smarthost": 4000.0}
    # the next start: a fresh engine, seeded; a name no longer configured is left out
    again = Engine(cfg, SpoolWriter(cfg.spool_path), clock=lambda: now["t"]).dests
    views.seed_failing_since(again, {**kept, "gone": 1.0, "smarthost-typo": "x"})
    assert set(again) == {"smarthost"}
    (d,) = views.health(again)
    assert (d.failing_for, d.answered) == (1000.0, False)
    # an answer clears it, and nothing is kept
    again.dest("smarthost").breaker.on_success(5001.0)
    assert views.failing_since(again) == {}
