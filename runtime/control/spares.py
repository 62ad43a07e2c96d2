"""Hot spares: idle workers started with the job whose programs are already compiled for the
slices they may take, so a lost slice is taken over with no process to start and nothing to
compile (ControlPlane(hot_spares=N), `cluster.hot_spares`).

A spare is warmed with every slice's programs, each for that slice's mesh (the Warm verb:
load into the worker's compile cache, then one call on zeros laid out as the program takes
its arguments; runtime/worker/programs.py warm), in the background, one Warm at a time across
all spares (on a machine whose cores also run the slices, two spares compiling at once would
only slow both). A spare's Setup and LoadPrograms on promotion then find every program in the
cache: the slice's first step after it compiles nothing (StepResult.compiles counts it).

`take` hands the control plane the first spare that still answers, once its warms are done
(a loss just after the start waits for them: still sooner than a spawn and a compile); the
control plane gives it the lost slice and calls `top_up(lost slot)`: once the run has taken
a step again (`went_on`), the launcher is asked for a worker in that slot in the background
(a new process for local and Ray, the next address for static: Launcher.replace, which also
stops the lost one where the launcher owns it) and it is warmed, so the count is restored
while the run goes on. When the launcher has
none, the count stays short and later losses fall back to Launcher.replace as without spares.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from mpmd.runtime.control.cluster import ReplaceUnsupported
from mpmd.runtime.control.rpc import WorkerError, call

log = logging.getLogger("mpmd")


def check_count(count) -> int:
    """`count` if it is a number of hot spares (a whole number >= 0); ValueError otherwise."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"hot_spares must be a whole number >= 0, got {count!r}")
    return count


def new_calls(known: dict, compiled: dict) -> dict:
    """Of a run's calls {program: [signature]}, those not in `known` (the calls a slice made
    so far, the same shape), now added to it: what the spares have yet to warm."""
    new = {n: [c for c in calls if c not in known.get(n, [])] for n, calls in compiled.items()}
    new = {n: calls for n, calls in new.items() if calls}
    for name, calls in new.items():
        known.setdefault(name, []).extend(calls)
    return new


class Spare:
    """One hot spare: the launcher slot it is in, its client, and its warms not yet done."""

    def __init__(self, slot: int, client):
        self.slot = slot
        self.client = client
        self.warming: list[Future] = []


class HotSpares:
    """The hot spares of one control plane.

    count: how many to keep. client_of(address) -> a client (a gang's for a tuple);
    new_worker(slot) -> the address of a worker the launcher starts (or hands out) in `slot`,
    ReplaceUnsupported when it has none; num_slices() the slices now;
    generation() the control plane's generation; connect_timeout_s as the control plane's.
    warm_request(slice, compiled) -> (a verbs.Warm, its blobs), None if nothing to warm:
    compiled None for every program of the slice for every call it compiled for so far (a
    new spare), {program: [signature]} for those programs and calls ([]: for the layouts
    the program was exported with)."""

    def __init__(
        self,
        count: int,
        *,
        client_of: Callable,
        new_worker: Callable[[int], object],
        warm_request: Callable[[int, dict | None], tuple | None],
        num_slices: Callable[[], int],
        generation: Callable[[], int],
        connect_timeout_s: float,
    ):
        self.count = check_count(count)
        self._client_of = client_of
        self._new_worker = new_worker
        self._warm_request = warm_request
        self._num_slices = num_slices
        self._generation = generation
        self._connect_timeout_s = connect_timeout_s
        self._spares: list[Spare] = []
        self._lock = threading.Lock()
        self._warmer: ThreadPoolExecutor | None = None
        self._toppers: list[threading.Thread] = []
        self._owed: list[int] = []  # launcher slots a spare is to be started in (top_up)
        self._closing = threading.Event()
        self.promoted = 0  # spares that took a lost slice's place
        self.started = 0  # spares started in the background to restore the count

    def attach(self, slots_addresses: list[tuple[int, object]]) -> None:
        """The spares a start found: (launcher slot, address) each; waits until they answer."""
        self.close()
        self._closing = threading.Event()
        self._warmer = ThreadPoolExecutor(1, thread_name_prefix="mpmd-warm")
        spares = [Spare(slot, self._client_of(a)) for slot, a in slots_addresses]
        for s in spares:
            s.client.wait_ready(self._connect_timeout_s)
        with self._lock:
            self._spares = spares

    @property
    def clients(self) -> list:
        """The spares' clients (heartbeats keep their lease; a new generation is given them)."""
        with self._lock:
            return [s.client for s in self._spares]

    @property
    def ready(self) -> int:
        """Spares held now whose warms are all done."""
        with self._lock:
            return sum(all(f.done() for f in s.warming) for s in self._spares)

    def warm(self, slice_index: int, compiled: dict) -> None:
        """Warm every spare with slice `slice_index`'s programs that `compiled` names, for the
        calls it gives ({program: [signature]}: a run's; [] for the layouts a program was
        exported with: just loaded)."""
        with self._lock:
            spares = list(self._spares)
        for s in spares:
            self._queue(s, slice_index, compiled)

    def _queue(self, spare: Spare, slice_index: int, compiled: dict | None = None) -> None:
        """Queue a Warm of slice `slice_index` on `spare` (compiled: as warm_request takes it)."""
        if self._warmer is None or self._closing.is_set():
            return
        request = self._warm_request(slice_index, compiled)
        if request is not None:
            spare.warming.append(self._warmer.submit(self._warm_one, spare, slice_index, *request))

    def _warm_one(self, spare: Spare, slice_index: int, request, blobs) -> None:
        if self._closing.is_set():
            return
        t0 = time.monotonic()
        try:
            reply = call(spare.client, request, blobs)[0]
        except WorkerError as e:  # a spare gone is found at `take`; a bad program at its Setup
            log.warning("hot spare %s: warming slice %d's programs failed: %s", spare.client.address, slice_index, e)
            return
        log.info(
            "hot spare %s: slice %d's %d program(s) warm, %d compiled in %.2f s",
            spare.client.address,
            slice_index,
            reply.loaded,
            reply.compiled,
            time.monotonic() - t0,
        )

    def take(self, alive: Callable) -> Spare | None:
        """The first spare that still answers (`alive(client)`), out of the pool, once its warms
        are done; None when there is none. Spares found gone are dropped (the count is
        restored for them by top_up's caller, as for any loss)."""
        while True:
            with self._lock:
                if not self._spares:
                    return None
                spare = self._spares.pop(0)
            for f in spare.warming:
                if f.exception() is not None:  # _warm_one logs a worker's refusal itself
                    log.warning("hot spare %s: a warm failed: %s", spare.client.address, f.exception())
            if alive(spare.client):
                self.promoted += 1
                return spare
            log.warning("hot spare %s does not answer; left out", spare.client.address)
            spare.client.close()

    def top_up(self, slot: int) -> None:
        """A new spare for launcher slot `slot` (the lost worker's), warmed with every slice's
        programs, joins the pool: started in the background by the next `went_on` (once the
        run has taken a step again: a process starting on the cores a recovery needs would
        slow the recovery down by as long as it takes to import JAX)."""
        with self._lock:
            self._owed.append(slot)

    def went_on(self) -> None:
        """A step completed: start the spares owed (top_up), if any."""
        if not self._owed:
            return
        with self._lock:
            owed, self._owed = self._owed, []
        for slot in owed:
            t = threading.Thread(target=self._top_up, args=(slot,), daemon=True, name=f"mpmd-spare-{slot}")
            self._toppers.append(t)
            t.start()

    def _top_up(self, slot: int) -> None:
        if self._closing.is_set():
            return
        try:
            address = self._new_worker(slot)
        except ReplaceUnsupported as e:
            log.warning("no new hot spare for slot %d (%s): %d left", slot, e, len(self.clients))
            return
        except Exception as e:  # a launcher failure here must not end the run the spare was for
            log.warning("starting a hot spare in slot %d failed: %s", slot, e)
            return
        client = self._client_of(address)
        try:
            client.wait_ready(self._connect_timeout_s)
        except WorkerError as e:
            log.warning("the new hot spare %s did not answer: %s", address, e)
            client.close()
            return
        client.generation = self._generation()
        spare = Spare(slot, client)
        with self._lock:
            if self._closing.is_set():
                client.close()
                return
            self._spares.append(spare)
            self.started += 1
        for i in range(self._num_slices()):
            self._queue(spare, i)

    def stop(self) -> None:
        """Stop warming and topping up; waits for a spare being started, so that the
        launcher's stop() afterwards leaves none running."""
        self._closing.set()
        for t in self._toppers:
            t.join()
        self._toppers = []
        if self._warmer is not None:
            self._warmer.shutdown(wait=True, cancel_futures=True)
            self._warmer = None

    def close(self) -> None:
        """stop(), then let go of the spares' clients (their workers are the launcher's to stop)."""
        self.stop()
        with self._lock:
            spares, self._spares = self._spares, []
        for s in spares:
            s.client.close()
