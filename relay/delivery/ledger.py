"""The daily ledger: deliveries counted per ceiling scope in the current window, and the
reservations of jobs in flight (pure; the spool holds the counts across restarts).

Rules:
- A scope is `dest:<destination>` or `id:<identity>`, the spool's `daily_counts.scope`.
- A job reserves its recipients against every ceiling that applies when it is dispatched;
  when it ends, the reservation is released and what was delivered is counted. So two jobs
  dispatched together cannot both take the last room under a ceiling.
- A new window (shaping.window_tz / window_length) starts the counts from zero;
  reservations of jobs in flight carry over (their deliveries land in the new window).
- Deliveries are counted per destination even without a ceiling, for `relay stats`.
- In a fleet (PostgreSQL spool) the ceilings are the database's: before a claim pass is
  dispatched, the engine takes room for it (ops.ceiling_take), and `room` is what is left
  of that grant (`grants`); what dispatch does not use goes back at the end of the pass.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from relay.config.tree import Identity
from relay.delivery import shaping


@dataclass(slots=True)
class Ledger:
    tz: dt.tzinfo
    window_length: float | None
    day: str = ""
    counts: dict[str, int] = field(default_factory=dict)  # delivered, this window
    reserved: dict[str, int] = field(default_factory=dict)  # in flight
    grants: dict[str, int] | None = None  # fleet: room the database granted this pass

    def day_of(self, now: float) -> str:
        return shaping.day_key(now, self.tz, self.window_length)

    def load(self, day: str, counts: dict[str, int]) -> None:
        self.day, self.counts = day, dict(counts)

    def roll(self, now: float) -> None:
        day = self.day_of(now)
        if day != self.day:
            self.day, self.counts = day, {}

    def today(self, scope: str) -> int:
        return self.counts.get(scope, 0)

    def limits(
        self, dest: str, dest_limit: int | None, identity: str, ident: Identity | None, now: float
    ) -> list[tuple[str, str, int]]:
        """(scope, display name, limit) for each ceiling that applies."""
        out = []
        if dest_limit is not None:
            out.append((f"dest:{dest}", dest, dest_limit))
        if ident is not None:
            lim = shaping.effective_daily_limit(ident.daily_limit, self.warmup_limit(ident, now))
            if lim is not None:
                out.append((f"id:{identity}", identity, lim))
        return out

    def warmup_limit(self, ident: Identity, now: float) -> int | None:
        """Today's warm-up ceiling of an identity (None: no warm-up)."""
        w = ident.warmup
        if w is None:
            return None
        today = dt.datetime.fromtimestamp(now, self.tz).date()
        return shaping.warmup_limit(
            shaping.Warmup(
                start=w.start,
                schedule=w.schedule,
                initial=w.initial,
                factor=w.factor,
                ceiling=w.ceiling,
            ),
            today,
        )

    def room(self, limits: list[tuple[str, str, int]], now: float) -> tuple[int, float, str] | None:
        """How many recipients fit under every ceiling now, with the next window and the
        reason for the rest; None when no ceiling applies."""
        self.roll(now)
        room: tuple[int, float, str] | None = None
        for scope, name, limit in limits:
            if self.grants is not None:
                left = max(0, self.grants.get(scope, 0))
            else:
                left = max(0, limit - self.counts.get(scope, 0) - self.reserved.get(scope, 0))
            if room is None or left < room[0]:
                nxt = shaping.next_window(now, self.tz, self.window_length)
                room = (left, nxt, shaping.ceiling_reason(limit, name, nxt))
        return room

    def reserve(self, scopes: tuple[str, ...], n: int) -> None:
        for scope in scopes:
            self.reserved[scope] = self.reserved.get(scope, 0) + n
            if self.grants is not None:
                self.grants[scope] = self.grants.get(scope, 0) - n

    def hand_over(
        self, scopes: tuple[str, ...], n: int, src: str, dst: str, dst_limit: int | None
    ) -> tuple[str, ...]:
        """A job dispatched to upstream `src` is carried by `dst` (failover): the
        reservation under `src`'s ceiling moves under `dst`'s (when it has one). Returns the
        job's scopes now. One engine only: a fleet's reservations are holds in the spool."""
        out = [scope for scope in scopes if scope != f"dest:{src}"]
        if len(out) != len(scopes):
            self.reserved[f"dest:{src}"] = max(0, self.reserved.get(f"dest:{src}", 0) - n)
        if dst_limit is not None:
            self.reserve((f"dest:{dst}",), n)
            out.append(f"dest:{dst}")
        return tuple(out)

    def release(
        self,
        scopes: tuple[str, ...],
        n: int,
        delivered: int,
        now: float,
        dest: str,
        dest_limited: bool,
    ) -> tuple[str, ...]:
        """A job ended: its reservation goes, its deliveries count. Returns the scopes whose
        spool counters to bump by `delivered`."""
        self.roll(now)
        out = []
        for scope in scopes:
            self.reserved[scope] = max(0, self.reserved.get(scope, 0) - n)
            self.counts[scope] = self.counts.get(scope, 0) + delivered
            out.append(scope)
        if not dest_limited:
            scope = f"dest:{dest}"
            self.counts[scope] = self.counts.get(scope, 0) + delivered
            out.append(scope)
        return tuple(dict.fromkeys(out))
