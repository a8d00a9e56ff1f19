"""The collector's settings of a long-running process once it has started (the daemon's main
process, an inbound process).

Rules:
- The objects start-up made (modules, config, compiled patterns, the listeners) live as long
  as the process: `gc.freeze()` moves them out of the collector's sight, so a full
  collection no longer walks them.
- The youngest generation is collected after `GC_YOUNG` allocations instead of 700: a
  message makes a few hundred objects, most freed by their reference count, so the default
  ran a collection every message or two. Measured: the inbound's CPU per message
  (bench/README.md, "f38e2bc"), and the main process's while it delivers 2 KiB mail,
  -6 to -7.5% (bench/README.md, "A fifteenth machine").
- Called once, after start-up and before the process reports ready.
"""

from __future__ import annotations

import gc

GC_YOUNG = 10_000  # allocations between collections of the youngest generation (700)


def settle_collector() -> None:
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
