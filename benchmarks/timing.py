"""Side-by-side step timing for the benchmarks: blocks of steps that alternate between the
cases compared, so that load on this shared machine falls on all of them alike."""

from __future__ import annotations

import time
from typing import Callable


def alternating_blocks(
    steps: dict[str, Callable[[int], object]], num_rounds: int, block: int
) -> dict[str, list[float]]:
    """Per case: seconds per step, from `num_rounds` rounds in which each case runs `block`
    steps (`steps[name](i)` runs step i), in the given order on even rounds and reversed on
    odd ones. A block's first step is not counted (it waits on what the block before left)."""
    times = {name: [] for name in steps}
    for r in range(num_rounds):
        for name in list(steps) if r % 2 == 0 else list(reversed(steps)):
            last = time.perf_counter()
            for i in range(block):
                steps[name](r * block + i)
                now = time.perf_counter()
                if i:
                    times[name].append(now - last)
                last = now
    return times
