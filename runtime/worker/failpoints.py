"""Failpoints: named places in a worker where a test makes it pause at a chosen moment, after
etcd's gofail. The fault tests (tests/runtime/test_hosts.py) pause a worker there, cut its
host off the network while it waits, and see the run survive the worker coming back.
tests/train/test_recovery.py makes one busy there instead: its Python answers nothing for a
while, its process runs on, and it must not be declared lost (runtime/control/heartbeat.py).

    MPMD_FAILPOINTS="save@2=pause:12,transfer@40=pause:10"

arms point `save` at its 2nd hit and `transfer` at its 40th (hits of a point are counted in
this process from 1, whichever session or run they belong to): there the worker logs one
WARNING line `failpoint save reached (hit 2: <what it was doing>); pausing 12 s`, sleeps
12 s in the thread that hit it, logs `failpoint save: going on`, and goes on. Every other hit
does nothing. `busy:seconds` in place of `pause:seconds` spins that long holding the GIL
(its switch interval raised), so no other thread of the worker runs Python meanwhile: no RPC
is answered, gRPC's own threads still accept connections and acknowledge pings. The variable is read once, when this module is first imported; unset or empty,
nothing is armed and a hit costs the caller one truthiness test of `armed` (call sites read
`if failpoints.armed: failpoints.hit(...)`).

The points (POINTS), each where a partition hurts most:
  save      a persistent save's writer thread (runtime/worker/slice_store.py) has taken a
            queued save to write: the Save RPC has returned, the controller counts the save
            as started, and nothing of the part is on disk yet; a worker paused here writes
            the whole part, into the directory its Save named, once it goes on
  snapshot  a plan copies a buffer into host memory (an in-memory snapshot,
            mpmd/train/snapshots.py: the slice's own copy, before it is sent to its peer)
  transfer  a plan is about to offer a buffer to another slice (a Send), before the offer
  restore   a Restore is about to read a checkpoint's parts (runtime/worker/executor.py)
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time

ENV = "MPMD_FAILPOINTS"
POINTS = ("save", "snapshot", "transfer", "restore")
log = logging.getLogger("mpmd.failpoints")

_ENTRY = re.compile(r"(?P<point>[a-z_]+)@(?P<hit>[0-9]+)=(?P<action>pause|busy):(?P<seconds>[0-9]+(\.[0-9]*)?)")


def parse(spec: str) -> dict[str, dict[int, tuple[str, float]]]:
    """{point: {hit number: (action, seconds)}} of a MPMD_FAILPOINTS value; ValueError naming
    the entry that is not `point@hit=pause:seconds` (or busy:seconds) with a known point and a
    hit >= 1."""
    armed: dict[str, dict[int, tuple[str, float]]] = {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        m = _ENTRY.fullmatch(entry)
        if m is None or m["point"] not in POINTS or int(m["hit"]) < 1:
            raise ValueError(
                f"{ENV} entry {entry!r} must be 'point@hit=pause:seconds' or busy:seconds (point one of "
                f"{', '.join(POINTS)}; hit counted from 1), e.g. 'save@2=pause:12'"
            )
        armed.setdefault(m["point"], {})[int(m["hit"])] = (m["action"], float(m["seconds"]))
    return armed


armed = parse(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}
_lock = threading.Lock()  # points are hit from several threads (RPC handlers, the writer)


def hit(point: str, doing: str = "") -> None:
    """Point `point` was reached (`doing`: what the worker was doing, for the log line); pause
    if this is the hit it is armed at."""
    assert point in POINTS, point
    pauses = armed.get(point)
    if not pauses:
        return
    with _lock:
        n = _hits[point] = _hits.get(point, 0) + 1
    action, seconds = pauses.get(n, (None, 0.0))
    if action is None:
        return
    what = "pausing" if action == "pause" else "busy, holding the GIL,"
    log.warning("failpoint %s reached (hit %d: %s); %s %g s", point, n, doing, what, seconds)
    if action == "pause":
        time.sleep(seconds)
    else:
        _spin(seconds)
    log.warning("failpoint %s: going on", point)


def _spin(seconds: float) -> None:
    """Hold the GIL for `seconds`: a thread waiting for it asks the holder to let go only
    after the switch interval, raised past the spin here."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 1.0)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pass
    finally:
        sys.setswitchinterval(interval)
