"""relay/ops/runtime.py: the collector's settings a process takes once it has started."""

from __future__ import annotations

import json
import subprocess
import sys

from relay.ops import runtime

PROBE = """
import gc, json
from relay.ops import runtime
before = (gc.get_freeze_count(), gc.get_threshold())
junk = [[i] for i in range(1000)]  # objects made at start-up, alive for the process's life
runtime.settle_collector()
print(json.dumps({"before": before, "after": (gc.get_freeze_count(), gc.get_threshold())}))
"""


def test_start_ups_objects_are_frozen_and_young_ones_collected_less_often() -> None:
    """In a process of its own (freezing is for the whole interpreter): everything alive at
    the call leaves the collector's sight, and the youngest generation's threshold becomes
    GC_YOUNG, the older ones' unchanged."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    got = json.loads(out)
    (frozen_before, (young_before, mid, old)), (frozen, threshold) = got["before"], got["after"]
    assert frozen_before == 0 and young_before == 700
    assert frozen >= 1000
    assert threshold == [runtime.GC_YOUNG, mid, old]
    assert young_before < runtime.GC_YOUNG
