"""The fleet part of the engine: this node's name, its leases on the claims it holds, its
heartbeat, and what it last saw of the other nodes (README "Running a fleet").

Rules:
- At start a single engine (SQLite spool) takes back every claim left in the spool; a
  fleet node (PostgreSQL spool) only those of its own previous life (a stable
  `fleet.node`) and those of any node whose lease ran out.
- Every lease/3 the node renews its leases and its heartbeat; in a fleet it also gives
  the claims of nodes whose lease ran out back to the queue, loads the fleet's deliveries
  of the day into the ledger, and tells the destinations how many live nodes share each
  rate.
- At stop the node gives its own claims back (due now) and leaves the node list.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from relay import __version__
from relay.config.tree import Config
from relay.delivery.ledger import Ledger
from relay.ops.logs import log_event
from relay.spool import ops
from relay.spool.writer import SpoolWriter

log = logging.getLogger("relay.delivery.engine")


def start_up(now: float, day: str, node: str, fleet: bool, c: Any) -> tuple[int, dict[str, int]]:
    """(claims made due again, the day's delivery counts): the engine's start-up reads."""
    if not fleet:  # the one engine of a SQLite spool: every claim in the spool was ours
        return ops.recover(c, now), ops.daily_counts(c, day)
    # a fleet: claims of this node's previous life (a stable fleet.node), and those of any
    # node whose lease ran out; live nodes' claims are theirs
    n = ops.recover(c, now, owner=node) + ops.reclaim_expired(c, now, node, day)
    return n, ops.daily_counts(c, day)


class Fleet:
    def __init__(
        self,
        config: Config,
        writer: SpoolWriter,
        *,
        get_config: Callable[[], Config],
        ledger: Ledger,
        clock: Callable[[], float],
        inflight: Callable[[], int],
        on_share: Callable[[int], None],
    ) -> None:
        self.writer = writer
        self._config = get_config
        self.ledger = ledger
        self.clock = clock
        self._inflight = inflight
        self._on_share = on_share  # how many live nodes share each destination's rate
        self.enabled = config.spool_pg is not None  # spool.backend: postgresql
        self.node = config.fleet.node or f"{socket.gethostname()}:{os.getpid()}"
        self.size = 1
        self.nodes: list[dict[str, Any]] = []  # at the last heartbeat (a fleet only)
        self.started_at = clock()

    @property
    def lease(self) -> float:
        return self._config().fleet.lease

    async def start(self, now: float, day: str) -> tuple[int, dict[str, int]]:
        return await self.writer.run(functools.partial(start_up, now, day, self.node, self.enabled))

    async def heartbeat_loop(self) -> None:
        """Every lease/3: renew this node's leases and heartbeat; in a fleet, also give the
        claims of nodes whose lease ran out back to the queue, and learn how many nodes
        share each destination's rate."""
        while True:
            now = self.clock()
            day = self.ledger.day_of(now)
            try:
                size, counts, self.nodes = await self.writer.run(
                    functools.partial(self._beat, now, day, self._inflight())
                )
            except Exception as e:
                log_event(log, logging.ERROR, "engine_error", "fleet heartbeat failed", exc=e)
            else:
                if counts is not None:  # the fleet's deliveries today, for stats and `waiting`
                    self.ledger.load(day, counts)
                self.size = size  # each node's share of the rates
                self._on_share(size)
            await asyncio.sleep(self.lease / 3)

    def _beat(
        self, now: float, day: str, inflight: int, c: Any
    ) -> tuple[int, dict[str, int] | None, list[dict[str, Any]]]:
        ops.renew_leases(c, self.node, now + self.lease)
        info = {"host": socket.gethostname(), "pid": os.getpid(), "version": __version__}
        ops.heartbeat(c, self.node, self.started_at, now, inflight, info)
        if not self.enabled:
            return 1, None, []
        n = ops.reclaim_expired(c, now, self.node, day)
        if n:
            log_event(
                log,
                logging.WARNING,
                "recovered",
                "claims of a node whose lease expired are due again",
                count=n,
            )
        ops.prune_nodes(c, now, 86400.0)
        nodes = ops.list_nodes(c, now, self.lease)
        live = max(1, sum(1 for n in nodes if n["alive"]))
        return live, ops.daily_counts(c, day), nodes

    async def leave(self, now: float) -> None:
        """At stop: this node's claims only back to the queue (the fleet's others are
        theirs), and this node off the list."""

        def give_back(c: Any) -> None:
            ops.recover(c, now, owner=self.node)
            ops.node_gone(c, self.node)

        await self.writer.run(give_back)
