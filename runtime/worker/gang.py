"""A slice that spans several processes (hosts): a *gang* of k worker processes that
together own the slice's mesh, as the hosts of a TPU slice do under Pathways.

Worker side (`join`): before it serves, each process of a gang joins the slice's own JAX
distributed group (`jax.distributed.initialize`; on CPU, collectives over gloo). From then on
`jax.devices()` is the whole slice's mesh (k x D devices, process 0's first) and
`jax.local_devices()` this process's D of them; a stage program is one SPMD program over the
whole mesh, run by every process of the gang on its own shards.

Controller side (`GangClient`): the k processes of a slice look like one worker to the
control plane. Every verb goes to all k at once (the same plan, the same Run message: one
Run per process per step) and succeeds only when all k answer; the first that fails is the
slice's failure, so losing one process is losing the slice. What a verb returns comes from
process 0 (losses and fetched buffers are replicated, or gathered inside the gang first;
see runtime/worker/executor.py). Setup is the control plane's own per process (each has its own
transfer address), through `members`.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("mpmd.gang")


def join(coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Join this slice's JAX distributed group; must run before JAX makes its backend.
    Returns once all `num_processes` have joined; raises (the process exits and the launcher
    names it) when they do not within `timeout_s`."""
    import jax
    from mpmd.runtime import compat

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The coordinator (process 0) binds the address given, not every interface (JAX's
    # default): a local gang's stays on loopback. Its service has no credential of its own.
    jax.distributed.initialize(
        coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=max(1, int(timeout_s)),
        coordinator_bind_address=coordinator,
    )
    if not compat.GANG_PERSISTENT_CACHE and jax.devices()[0].platform == "cpu":
        # jaxlib 0.12's CPU gangs hang on programs from the persistent cache (compat says
        # why): every process compiles its own, as on a cold cache. Before any compile, when
        # JAX first reads the setting.
        jax.config.update("jax_enable_compilation_cache", False)
    # Orbax's barriers are XLA collectives unless told otherwise; a collective run by the
    # background checkpoint writer could interleave differently with a step's collectives on
    # two processes and hang both. Barriers through the distributed client touch no device.
    from absl import flags
    import orbax.checkpoint  # noqa: F401  (defines the flag)

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True
    log.info(
        "joined gang at %s as process %d of %d: %d device(s) in the slice, %d here",
        coordinator,
        process_id,
        num_processes,
        len(jax.devices()),
        len(jax.local_devices()),
    )


# Set in the gang's distributed key-value store by the first process that leaves; the others,
# polling it every PEERS_POLL_S, leave with it (see announce_leaving).
LEAVING_KEY = "mpmd/gang/leaving"
PEERS_POLL_S = 0.5


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def announce_leaving(process_id: int, why: str) -> None:
    """Tell the gang's other processes that this one leaves, and why: they leave with it
    (follow_peers). A peer left behind loses the distributed service once process 0 is gone,
    and JAX aborts it (SIGABRT): seen when a gang member cut off from its host's network and
    back had its lease renewed after process 0's had lapsed (tests/runtime/test_hosts.py)."""
    try:
        _client().key_value_set(LEAVING_KEY, f"process {process_id}: {why}")
    except Exception as e:  # another announced first, or the service is gone: nothing to tell
        log.debug("could not announce leaving the gang: %s", e)


def follow_peers(stop) -> None:
    """Watch for a peer's announce_leaving (a daemon thread): then stop(why) this process too."""

    def watch():
        client = _client()
        while True:
            time.sleep(PEERS_POLL_S)
            try:
                why = client.key_value_try_get(LEAVING_KEY)
            except Exception:  # not set (nobody leaves), or the service unreachable for now
                continue
            stop(f"its gang leaves ({why})")
            return

    threading.Thread(target=watch, daemon=True, name="mpmd-gang-peers").start()


def leave(wait_s: float) -> None:
    """Leave the distributed group at shutdown, in step with the gang: jax.distributed's
    shutdown waits until every process has called it, and only then does process 0 stop the
    service. Exiting without it raced: process 0 gone first took the service with it, and a
    peer still closing saw its client lose the service and abort (SIGABRT: seen once, in
    test_static_gangs_of_mpmd_worker_processes during a full-suite run). When the controller stops a gang,
    all its processes get here together; a peer that is dead never does, so the wait is
    bounded by `wait_s` (then the process exits anyway, as before)."""
    import jax

    done = threading.Event()

    def shutdown():
        try:
            jax.distributed.shutdown()
        except Exception as e:  # the service or a peer already gone: nothing to wait for
            log.info("left the gang without its shutdown barrier: %s", e)
        done.set()

    threading.Thread(target=shutdown, daemon=True, name="mpmd-gang-leave").start()
    if not done.wait(wait_s):
        log.info("a gang peer did not reach shutdown within %.0f s: leaving without it", wait_s)


class GangFuture:
    """The futures of one RPC sent to every process of a gang, as one: done when all are done
    or one failed; its exception is the first failure (a grpc.RpcError, as a single
    worker's would be)."""

    def __init__(self, futures: list):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures) or self.exception_now() is not None

    def exception_now(self):
        for f in self.futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                return f.exception()
        return None

    def exception(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.005)
        return self.exception_now()

    def cancelled(self) -> bool:
        return any(f.cancelled() for f in self.futures) and self.exception_now() is None

    def cancel(self) -> bool:
        return any([f.cancel() for f in self.futures])

    def add_done_callback(self, fn) -> None:
        # Called once: when the last member is done, or at the first failure.
        fired, lock = [], threading.Lock()

        def member_done(_f):
            with lock:
                if fired or not self.done():
                    return
                fired.append(True)
            fn(self)

        for f in self.futures:
            f.add_done_callback(member_done)


class GangClient:
    """The control plane's client for one slice served by a gang: `members[j]` is a
    mpmd.runtime.control.rpc.WorkerClient for process j. Same verbs as a WorkerClient."""

    def __init__(self, members: list):
        self.members = members
        self.address = tuple(m.address for m in members)
        self.service = members[0].service  # a worker's: runtime/wire/verbs.py WORKER_SERVICE
        self.progress = None  # process 0's, from the last heartbeat
        self.progress_at = time.monotonic()  # when `progress` last changed

    @property
    def last_ok(self) -> float:
        return min(m.last_ok for m in self.members)  # the gang is as alive as its quietest

    @property
    def generation(self) -> int:
        return self.members[0].generation

    @generation.setter
    def generation(self, value: int) -> None:
        for m in self.members:
            m.generation = value

    def wait_ready(self, timeout_s: float) -> None:
        for m in self.members:
            m.wait_ready(timeout_s)

    def future(self, method: str, header: dict | None = None, blobs=(), timeout_s: float | None = None):
        return GangFuture([m.future(method, header, blobs, timeout_s) for m in self.members])

    def result(self, method: str, fut: GangFuture):
        """Process 0's reply once every process answered; at the first failure, the others
        are cancelled (a survivor may wait forever in a collective with the lost one) and
        that failure is raised as a WorkerClient would raise it."""
        fut.exception()  # waits: all done, or one failed
        for m, f in zip(self.members, fut.futures):
            if f.done() and not f.cancelled() and f.exception() is not None:
                for other in fut.futures:
                    other.cancel()
                m.result(method, f)  # raises
        return [m.result(method, f) for m, f in zip(self.members, fut.futures)][0]

    def call(self, method: str, header: dict | None = None, blobs=(), timeout_s: float | None = None):
        return self.result(method, self.future(method, header, blobs, timeout_s))

    def close(self) -> None:
        for m in self.members:
            m.close()


class Agreement:
    """The processes of a gang decide together whether a run goes on, at every point where
    one of them alone could stop it: its start, and each receive (an Abort arrives at each
    process at its own moment, and a receive may fail on one process and land on another).
    Between two such points every process dispatches the same programs, so a collective one
    of them starts is always joined by the others; a process that stopped alone would leave
    its peers in a collective forever.

    Each process writes its verdict for a point into the gang's key-value store (the JAX
    distributed service of runtime/gang.join) and, if its own is "go on", reads the others':
    the run goes on only if every process says so. One write and k-1 reads per point per
    process, inside the gang; the controller sends nothing more. A process that said "go on"
    follows the gang's verdict, whatever it learns meanwhile: its peers decide the same way.
    """

    def __init__(self, namespace: str):
        import jax
        from mpmd.runtime import compat

        self._client = compat.distributed_client()
        self._rank, self._num_processes = jax.process_index(), jax.process_count()
        self._namespace = namespace
        self._written: dict[int, list[str]] = {}  # run id -> keys this process wrote

    def decide(self, run: int, point: str, go_on: bool) -> bool:
        """Whether every process of the gang goes on past `point` of run `run`."""
        self._forget_before(run)
        key = f"{self._namespace}/{run}/{point}"
        self._client.key_value_set(f"{key}/{self._rank}", "1" if go_on else "0")
        self._written.setdefault(run, []).append(f"{key}/{self._rank}")
        if not go_on:
            return False
        return all(
            self._client.blocking_key_value_get(f"{key}/{p}", 2**31 - 1) == "1"
            for p in range(self._num_processes)
            if p != self._rank
        )

    def _forget_before(self, run: int) -> None:
        # Keys of runs before the previous one have been read: every peer has since said
        # "go on" at the start of a later run, which it does only after finishing the earlier.
        older = sorted(r for r in self._written if r < run)
        for r in older[:-1]:
            for key in self._written.pop(r):
                self._client.key_value_delete(key)


def group_addresses(addresses, processes_per_slice: int | None = None) -> list:
    """Per slot, the address of its worker ("host:port") or of each process of its gang (a
    tuple, process 0 first), from a flat list cut into runs of `processes_per_slice` (None:
    1) or a list of lists (one per slot, all of that length; None: any one length).
    ValueError naming what is wrong."""
    if processes_per_slice is not None and (
        not isinstance(processes_per_slice, int) or isinstance(processes_per_slice, bool) or processes_per_slice < 1
    ):
        raise ValueError(f"processes_per_slice must be a positive integer or None, got {processes_per_slice!r}")
    addresses = list(addresses) if isinstance(addresses, (list, tuple)) else addresses
    is_address = lambda a: isinstance(a, str) and a.rpartition(":")[2].isdigit() and a.rpartition(":")[0] != ""
    if not isinstance(addresses, list) or not addresses:
        raise ValueError(
            f"addresses must be a non-empty list of 'host:port' strings, or of lists of them "
            f"(one list per slice: its gang's processes), got {addresses!r:.200}"
        )
    if any(isinstance(a, (list, tuple)) for a in addresses):
        if not all(isinstance(a, (list, tuple)) and a for a in addresses):
            raise ValueError(
                f"addresses mixes single addresses and lists: give every slice a list of its "
                f"processes' 'host:port' (or a flat list with processes_per_slice), got {addresses!r:.200}"
            )
        sizes = sorted({len(a) for a in addresses})
        if len(sizes) > 1:
            raise ValueError(
                f"every slice's gang must have the same number of processes; the address lists "
                f"have {', '.join(map(str, sizes))}"
            )
        if processes_per_slice not in (None, sizes[0]):
            raise ValueError(
                f"processes_per_slice={processes_per_slice} but each address list names {sizes[0]} process(es)"
            )
        groups = [tuple(a) for a in addresses]
    else:
        processes_per_slice = processes_per_slice or 1
        if len(addresses) % processes_per_slice:
            raise ValueError(
                f"{len(addresses)} address(es) cannot be cut into gangs of processes_per_slice="
                f"{processes_per_slice}: give a multiple of it (process 0 of each gang first)"
            )
        groups = [tuple(addresses[i : i + processes_per_slice]) for i in range(0, len(addresses), processes_per_slice)]
    flat = [a for g in groups for a in g]
    bad = [a for a in flat if not is_address(a)]
    if bad:
        raise ValueError(f"address {bad[0]!r:.100} must be 'host:port'")
    twice = sorted({a for a in flat if flat.count(a) > 1})
    if twice:
        raise ValueError(
            f"addresses list {', '.join(twice)} more than once: each worker process serves one "
            f"slice's gang or waits as (part of) one spare"
        )
    return [g[0] if len(g) == 1 else g for g in groups]
