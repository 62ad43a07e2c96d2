"""Several hosts on one machine (tests/support/netns.py): the controller and the workers in
network namespaces of their own, each with its own address, joined by a bridge.

- The data plane picks its path per pair of slices by host: shared memory between two
  workers of one namespace, sockets between namespaces (abstract Unix sockets, which the
  shared-memory endpoints are, belong to the network namespace); each worker logs the path.
- A worker whose link is cut mid-run is declared lost and replaced by a spare on another
  host; its link is restored while it still runs (a zombie: its lease has not lapsed) and it
  disturbs nothing: the run ends with the losses of an uninterrupted one, every committed
  step names only the new generation's parts, and the zombie leaves once its lease lapses.
- The controller cut off from every worker, with no spare: the static cluster waits for the
  lost worker, takes it back once the link returns, and the run goes on with both slices.
- A worker cut off at a failpoint (runtime/worker/failpoints.py: it pauses there, and the
  test cuts its link once its log says so): in the middle of a transfer, of a persistent
  save, of an in-memory snapshot; replaced by a spare, back while still paused, then going
  on as a zombie. And a replacement cut off while it restores, taken back once it answers
  again; and one process of a gang (a slice of two processes on two hosts) cut from its gang.

Every fault ends with the losses of an uninterrupted run, bitwise; every committed checkpoint
verifies and holds nothing a worker of an older generation wrote
(tests/support/recovery_runs.py assert_commits_verify); every worker left behind in an
older generation has left on its own, its lease lapsed.
"""

import os
import re
import subprocess
import sys
import time
from typing import NamedTuple

import pytest

from mpmd.recipes.run import run_log
from mpmd.runtime.worker import failpoints
from mpmd.runtime.worker.slice_store import CheckpointStore
from tests.support import netns
from tests.support.processes import ROOT, Controller, StandaloneWorkers, logged_at, tiny_gpt_run
from tests.support.recovery_runs import assert_commits_verify

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # real worker processes in network namespaces (tests/README.md)

STEPS, EVERY = 16, 4
OVERRIDES = tiny_gpt_run(STEPS, EVERY)
LEASE_S = 15.0  # the cut-off worker's: it is still running when its link comes back
# The failpoint rows': a worker pauses PAUSE_S at its failpoint, longer than it takes the run
# to lose it and recover; its lease outlasts the pause, so it goes on, back on the network,
# as a zombie before it leaves.
PAUSE_S, ZOMBIE_LEASE_S = 12.0, 22.0
# The workers a stopped run is resumed on must outlive the time from the cut to the second
# controller's start (its end, the commits' check, its start): 15 s was not enough under load.
RESUME_LEASE_S = 60.0


@pytest.fixture(autouse=True)
def _root():
    netns.skip_unless_root()


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_log.read(run_dir)}


def assert_same_losses(run_dir, reference: dict[int, float]) -> None:
    got = losses(run_dir)
    assert got == reference, f"the losses differ from the uninterrupted run's: {got} != {reference}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The same run on local workers, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("hosts") / "reference"
    Controller(run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES]).succeed()
    return losses(run_dir)


def gang(k: int) -> list[str]:
    """The overrides of slices that are gangs of k processes, data-parallel over them."""
    return [f"cluster.processes_per_slice={k}", f"mesh.data={k}"]


def train_on_host_0(hosts, run_dir, *overrides) -> Controller:
    """The tiny run (OVERRIDES, then `overrides`), its controller in host 0."""
    return Controller(
        run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES, *overrides], prefix=["ip", "netns", "exec", hosts.names[0]]
    )


def left_on_lease(workers, indices, lease_s: float) -> list[str]:
    """The logs of workers `indices`, once each has left on its own, its lease lapsed (nobody
    called it any more); fails if one does not within `lease_s` + 30 s or exits otherwise."""
    codes = [workers.procs[i].wait(timeout=lease_s + 30) for i in indices]
    logs = [workers.logs[i].read_text() for i in indices]
    assert codes == [0] * len(indices) and all("controller silent" in log for log in logs), (
        codes,
        [log[-2000:] for log in logs],
    )
    return logs


def static(workers, slices: list[int], spares: list[int] = (), processes_per_slice: int = 1, **cluster) -> list[str]:
    """The overrides of a static cluster of workers `slices` (then `spares`), by index, each
    slice a gang of `processes_per_slice` of them, data-parallel over the gang."""
    quote = lambda idx: "[" + ",".join(f'"{workers.addresses[i]}"' for i in idx) + "]"
    return [
        "cluster.backend=static",
        f"pipeline.num_stages={len(slices) // processes_per_slice}",
        *(gang(processes_per_slice) if processes_per_slice > 1 else []),
        f"cluster.addresses={quote(slices)}",
        f"cluster.spares={quote(spares)}",
        f"cluster.token_file={workers.root.parent / 'token'}",
        *(f"cluster.{k}={v}" for k, v in cluster.items()),
    ]


def paths_logged(log: str) -> dict[tuple[int, int], str]:
    """{(receiving slice, sending slice): "shared memory" | "sockets"} from a worker's log."""
    found = re.findall(r"slice (\d+) receives from slice (\d+) through (shared memory|sockets)", log)
    return {(int(a), int(b)): how for a, b, how in found}


def test_shared_memory_within_a_host_and_sockets_between_hosts(tmp_path, reference):
    """Host 0: the controller; host 1: the workers of slices 0 and 1; host 2: slice 2's. The
    transfers between slices 0 and 1 go through shared memory, those between 1 and 2 through
    sockets, and the run's losses are the local run's."""
    with netns.Hosts(3) as hosts:
        with StandaloneWorkers(tmp_path, 3, shared=False, hosts=hosts, on=[1, 1, 2]) as workers:
            run_dir = workers.root / "run"
            train_on_host_0(hosts, run_dir, *static(workers, [0, 1, 2])).succeed()
            paths = {}
            for log in workers.logs:
                paths.update(paths_logged(log.read_text()))
    assert paths[1, 0] == paths[0, 1] == "shared memory", paths
    assert paths[2, 1] == paths[1, 2] == "sockets", paths
    got = losses(run_dir)
    assert sorted(got) == sorted(reference) and all(abs(got[s] - reference[s]) < 1e-6 for s in got), (got, reference)


def test_a_worker_cut_off_is_replaced_and_once_back_disturbs_nothing(tmp_path, reference):
    """Host 0: the controller; hosts 1 and 2: the slices; host 3: a spare. Host 2's link is cut
    after step 6; slice 1 is declared lost (failure_timeout_s=2) and the spare takes it from
    the last checkpoint. Host 2 comes back after step 12, its worker still running in the old
    generation. The run ends with the uninterrupted run's losses; every committed step's
    parts are the new generation's; the cut-off worker leaves on its own."""
    with netns.Hosts(4) as hosts:
        with StandaloneWorkers(tmp_path, 3, shared=False, hosts=hosts, on=[1, 2, 3], lease_s=LEASE_S) as workers:
            run_dir = workers.root / "run"
            run = train_on_host_0(hosts, run_dir, *static(workers, [0, 1], [2], failure_timeout_s=2))
            run.wait_for_step(6)
            hosts.cut(2)
            cut_at = time.monotonic()
            run.wait_for_step(12, timeout_s=120)
            hosts.restore(2)
            back_after = time.monotonic() - cut_at
            out = run.succeed()
            zombie = workers.procs[1]
            assert zombie.poll() is None or back_after < LEASE_S, "the cut-off worker left before its link came back"
            left_on_lease(workers, [1], LEASE_S)
    assert "lost" in out, out[-3000:]
    assert_same_losses(run_dir, reference)
    for step, parts in assert_commits_verify(run_dir).items():
        if step > 4:  # after the replacement: not the first generation
            assert all(not p.split(".", 1)[1].startswith("g1-") for p in parts), (step, parts)


def test_the_controller_cut_off_from_every_worker_waits_then_goes_on_with_them(tmp_path, reference):
    """Host 0 (the controller) loses its link for 4 s after step 6, with no spare: every slice
    falls silent, the first is declared lost (failure_timeout_s=2), and with nothing else to
    hand out the static cluster waits for the lost worker to answer again
    (cluster.replace_timeout_s), takes it back in a new generation, restores and replays.
    Both workers serve to the end, the run keeps its two slices, its losses are the
    uninterrupted run's."""
    with netns.Hosts(3) as hosts:
        with StandaloneWorkers(tmp_path, 2, shared=False, hosts=hosts, on=[1, 2], lease_s=LEASE_S) as workers:
            run_dir = workers.root / "run"
            run = train_on_host_0(hosts, run_dir, *static(workers, [0, 1], failure_timeout_s=2))
            run.wait_for_step(6)
            hosts.cut(0)
            time.sleep(4)
            hosts.restore(0)
            out = run.succeed()
            assert [p.wait(timeout=10) for p in workers.procs] == [0, 0]
            # Both served to the end: the controller shut them down, neither left on its own.
            assert all("shutting down: controller asked" in log.read_text() for log in workers.logs)
            assert "recovered" in out and "continuing on 1 slice" not in out, out[-3000:]
    assert_same_losses(run_dir, reference)


def test_the_controller_cut_off_stops_cleanly_when_told_not_to_wait_and_resumes_after(tmp_path, reference):
    """The same cut, with cluster.on_loss=replace and replace_timeout_s=1: the lost worker is
    not back within the second the run may wait, so it stops, with one line naming the last
    committed step, and commits nothing it did not finish. Run again once the link is back,
    over the same workers (the new controller's generation supersedes the old one's), it
    resumes from that step and ends with the uninterrupted run's losses."""
    with netns.Hosts(3) as hosts:
        with StandaloneWorkers(tmp_path, 2, shared=False, hosts=hosts, on=[1, 2], lease_s=RESUME_LEASE_S) as workers:
            run_dir = workers.root / "run"
            args = static(workers, [0, 1], failure_timeout_s=2, on_loss="replace", replace_timeout_s=1)
            run = train_on_host_0(hosts, run_dir, *args)
            run.wait_for_commit()
            hosts.cut(0)
            rc, out = run.finish()
            hosts.restore(0)
            err = run.stderr_path.read_text()
            assert rc == 1, (rc, out[-2000:], err[-3000:])
            committed = CheckpointStore(run_dir).committed()
            assert committed and f"last committed checkpoint: step {committed[-1]}" in err, err[-3000:]
            assert_commits_verify(run_dir)
            again = train_on_host_0(hosts, run_dir, *args)
            out = again.succeed()
            assert f"resumed from {run_dir / 'checkpoints' / str(committed[-1])}" in out + again.stderr_path.read_text()
            assert [p.wait(timeout=10) for p in workers.procs] == [0, 0]
    assert_same_losses(run_dir, reference)
    assert_commits_verify(run_dir)


class Row(NamedTuple):
    """A failpoint row: slice 1's worker (host 2) pauses at `failpoint` (its MPMD_FAILPOINTS)
    and the test cuts host 2 there, once step `committed` is committed; the spare (host 3)
    pauses at `spare_failpoint`, if any."""

    failpoint: str
    committed: int = 4
    spare_failpoint: str = ""
    overrides: tuple[str, ...] = ()


ROWS = {
    # Step 7's first send of slice 1 (5 a step: the gradients of 4 microbatches, the squared
    # norm for clipping): the gradient of microbatch 0 for slice 0.
    "transfer": Row(f"transfer@31=pause:{PAUSE_S:g}"),
    # The save of step 12 (a checkpoint every 4 steps), and the spare's first, its step 12.
    "save": Row(f"save@3=pause:{PAUSE_S:g}", committed=8, spare_failpoint=f"save@1=pause:{PAUSE_S:g}"),
    # Step 6's snapshot (every 2 steps), slice 1's own copy: each snapshot copies two buffers
    # to host memory, its own state and its peer's copy.
    "snapshot": Row(f"snapshot@5=pause:{PAUSE_S:g}", overrides=("checkpoint.memory_every=2",)),
}


@pytest.mark.parametrize("row", ROWS)
def test_a_worker_cut_off_at_a_failpoint_is_replaced_and_once_back_disturbs_nothing(tmp_path, reference, row):
    """Host 0: the controller; hosts 1 and 2: the slices; host 3: a spare. Slice 1's worker
    pauses at a failpoint; the test cuts host 2 there, once the checkpoint before is
    committed (its save is written in the background meanwhile). The worker is declared lost
    (failure_timeout_s=2), the spare takes slice 1 and the run goes on; host 2 comes back
    once the run recovered, while the worker still pauses, and then it goes on where it
    stopped, in its old generation:
    - transfer: slice 1 stopped just before it offers step 7's first gradient to slice 0.
      Slice 0 has posted its receive of it (receives are posted at the step's start), so its
      pull waits in slice 1's transfer table for an offer. Back, the zombie makes its offer
      (keyed with its generation, in a run id no later run reuses): nobody pulls it.
    - save: slice 1's writer thread stopped as it takes step 12's save to write (the Save RPC
      returned; nothing of the part is on disk). The spare restores step 8, replays, and
      its own writer stops at its save of step 12 alike. Meanwhile the zombie goes on and
      writes its whole part of step 12, into its generation's directory; then the spare
      writes its part into its own, and step 12 is committed with the spare's. (With the
      part directories not named for their generation, the zombie's write took the spare's
      place and the spare's save of step 12 failed: "Destination ... already exists".)
    - snapshot: slice 1 stopped as it copies its state to host memory in step 6's in-memory
      snapshot, before sending the copy to slice 0: a half-done snapshot generation. The
      spare restores from its peer's copy of step 4's snapshot.
    The run ends with the uninterrupted run's losses; every committed step verifies and names
    only one generation's parts, none the zombie's; the zombie leaves once its lease lapses."""
    spec = ROWS[row]
    env_of = {1: {failpoints.ENV: spec.failpoint}, 2: {failpoints.ENV: spec.spare_failpoint}}
    with netns.Hosts(4) as hosts:
        with StandaloneWorkers(
            tmp_path, 3, shared=False, hosts=hosts, on=[1, 2, 3], lease_s=ZOMBIE_LEASE_S, env_of=env_of
        ) as workers:
            run_dir = workers.root / "run"
            run = train_on_host_0(hosts, run_dir, *spec.overrides, *static(workers, [0, 1], [2], failure_timeout_s=2))
            assert workers.logged(1, f"failpoint {row} reached", timeout_s=120), workers.logs[1].read_text()[-3000:]
            # It pauses there: first the checkpoint before, written meanwhile, is committed.
            assert run.wait_for_commit(step=spec.committed) == spec.committed
            hosts.cut(2)
            run.wait_for(lambda line: line.startswith("recovered"), "recovery", timeout_s=60)
            hosts.restore(2)
            back_at = time.time()
            out = run.succeed()
            (log,) = left_on_lease(workers, [1], ZOMBIE_LEASE_S)
            spare = workers.logs[2].read_text()
    went_on = logged_at(next((l for l in log.splitlines() if f"failpoint {row}: going on" in l), ""))
    assert went_on > back_at, f"the zombie went on before its link came back (or never):\n{log[-3000:]}"
    assert "recovered" in out, out[-3000:]
    if row == "snapshot":
        assert "from the in-memory snapshot" in out, out[-3000:]
    assert_same_losses(run_dir, reference)
    written = re.search(r"failpoint save reached \(hit \d+: writing (\S+)\)", log)
    committed = assert_commits_verify(run_dir, stale=[written[1]] if written else ())
    if row == "save":
        # The zombie wrote its part of step 12 while the spare's write of it was held.
        held = [logged_at(l) for l in spare.splitlines() if "failpoint save" in l]
        assert len(held) == 2 and held[0] < went_on < held[1], (held, went_on, spare[-3000:])
        after = [l for l in log.splitlines() if written[1] in l and logged_at(l) >= went_on]
        assert after, f"the zombie did nothing with {written[1]} once it went on:\n{log[-3000:]}"
        assert 12 in committed, committed


def test_a_replacement_cut_off_while_it_restores_is_taken_back_once_it_answers(tmp_path, reference):
    """Host 0: the controller; hosts 1 and 2: the slices; host 3: a spare. Host 2 is cut once
    step 4 is committed: the spare replaces slice 1's worker (generation 2) and, as every
    slice restores step 4, pauses at its failpoint `restore` (before reading the checkpoint);
    the test cuts host 3 there. The recovery loses the spare too (its Restore unanswered),
    finds no spare left, and waits for the lost worker to answer again
    (cluster.replace_timeout_s). Host 3 comes back 4 s later: the spare is taken back in
    generation 3, restores again and serves to the end, its first Restore still paused (it
    goes on, if before the run ends, into the executor generation 2's Setup made, which
    nothing uses any more). Once it serves generation 3, a call of generation 2 (what the cut
    connection's packets carry when they arrive late) is refused. Host 2 comes back after
    that; its worker leaves once its lease lapses."""
    with netns.Hosts(4) as hosts:
        with StandaloneWorkers(
            tmp_path,
            3,
            shared=False,
            hosts=hosts,
            on=[1, 2, 3],
            lease_s=ZOMBIE_LEASE_S,
            env_of={2: {failpoints.ENV: f"restore@1=pause:{PAUSE_S:g}"}},
        ) as workers:
            run_dir = workers.root / "run"
            caller = StaleCaller(hosts, 0, workers.root.parent / "token")
            run = train_on_host_0(hosts, run_dir, *static(workers, [0, 1], [2], failure_timeout_s=2))
            assert run.wait_for_commit() == 4
            hosts.cut(2)
            assert workers.logged(2, "failpoint restore reached", timeout_s=60), workers.logs[2].read_text()[-3000:]
            hosts.cut(3)
            time.sleep(4)
            hosts.restore(3)
            refused = caller.stale(workers.addresses[2], old=2, new=3)
            hosts.restore(2)
            out = run.succeed()
            left_on_lease(workers, [1], ZOMBIE_LEASE_S)
            assert [p.wait(timeout=10) for p in (workers.procs[0], workers.procs[2])] == [0, 0]
            spare = workers.logs[2].read_text()
            assert "shutting down: controller asked" in spare
    assert refused.startswith("FAILED_PRECONDITION") and "stale generation 2" in refused, refused
    # Its first Restore, of generation 2, was still paused when it was taken back.
    controller_log = (run_dir / "logs" / "controller.log").read_text().splitlines()
    readmitted = logged_at(next(l for l in controller_log if "answers again" in l))
    went_on = [logged_at(l) for l in spare.splitlines() if "failpoint restore: going on" in l]
    assert all(t > readmitted for t in went_on), spare[-3000:]
    assert "recovered" in out, out[-3000:]
    assert_same_losses(run_dir, reference)
    for step, parts in assert_commits_verify(run_dir).items():
        if step > 4:  # after the readmission
            assert all(p.split(".", 1)[1].startswith("g3-") for p in parts), (step, parts)


class StaleCaller:
    """A process on host `i` that calls workers as a superseded connection would: `stale`
    waits until a worker reports (Hello) that it serves generation `new`, then makes a
    Heartbeat of generation `old`; what the worker answered ("accepted", or its status code
    and details)."""

    SCRIPT = """
import collections, sys, time
from mpmd.runtime.control.rpc import WorkerClient, WorkerError, call
from mpmd.runtime.wire import verbs
token = open(sys.argv[1]).read().strip()
print("ready", flush=True)
for line in sys.stdin:
    address, old, new = line.split()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = WorkerClient(address, token, collections.Counter())
        try:
            if call(c, verbs.Empty(), timeout_s=1, verb="Hello")[0].generation == int(new):
                break
        except WorkerError:
            pass
        finally:
            c.close()
        time.sleep(0.05)
    c = WorkerClient(address, token, collections.Counter())
    c.generation = int(old)
    try:
        call(c, verbs.Empty(), timeout_s=5, verb="Heartbeat")
        print("accepted", flush=True)
    except WorkerError as e:
        print(f"{e.code.name if e.code else '?'} {e.details}", flush=True)
    c.close()
"""

    def __init__(self, hosts, i: int, token_file):
        self.proc = hosts.popen(
            i,
            [sys.executable, "-c", self.SCRIPT, str(token_file)],
            cwd=ROOT,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def stale(self, address: str, old: int, new: int) -> str:
        self.proc.stdin.write(f"{address} {old} {new}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


@pytest.fixture(scope="module")
def gang_reference(tmp_path_factory) -> dict[int, float]:
    """The same run on local gangs (LocalCluster, two processes a slice), uninterrupted."""
    run_dir = tmp_path_factory.mktemp("hosts") / "gang_reference"
    Controller(run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES, *gang(2)]).succeed()
    return losses(run_dir)


def test_a_gang_member_cut_from_its_gang_loses_the_slice_whose_gang_is_replaced(tmp_path, gang_reference):
    """Slices are gangs of two processes (runtime/worker/gang.py). Host 0: the controller; host
    1: slice 0's gang; host 2 and host 3: process 0 and process 1 of slice 1's gang; host 4: a
    spare gang. Process 1 of slice 1 pauses before it offers step 7's first gradient to slice
    0 (failpoint `transfer`); the test cuts host 3 there, off the controller, the other
    slices and its own gang's coordinator and collectives. The slice is lost whole, the spare
    gang takes it, and host 3 comes back once the run recovered, its process still paused.
    The run ends with the losses of an uninterrupted run on gangs, bitwise; both processes of
    the old gang leave once their leases lapse (process 0 was never cut off: nobody calls it
    any more); every committed step verifies."""
    with netns.Hosts(5) as hosts:
        with StandaloneWorkers(
            tmp_path,
            6,
            shared=False,
            hosts=hosts,
            on=[1, 1, 2, 3, 4, 4],
            lease_s=ZOMBIE_LEASE_S,
            env_of={3: {failpoints.ENV: f"transfer@31=pause:{PAUSE_S:g}"}},
            processes_per_slice=2,
        ) as workers:
            run_dir = workers.root / "run"
            run = train_on_host_0(hosts, run_dir, *static(workers, [0, 1, 2, 3], [4, 5], 2, failure_timeout_s=2))
            assert workers.logged(3, "failpoint transfer reached", timeout_s=120), workers.logs[3].read_text()[-3000:]
            assert run.wait_for_commit() == 4
            hosts.cut(3)
            run.wait_for(lambda line: line.startswith("recovered"), "recovery", timeout_s=60)
            hosts.restore(3)
            back_at = time.time()
            out = run.succeed()
            logs = left_on_lease(workers, [2, 3], ZOMBIE_LEASE_S)  # the old gang
    went_on = [l for l in logs[1].splitlines() if "failpoint transfer: going on" in l]
    assert went_on and logged_at(went_on[0]) > back_at, (
        f"process 1 went on before its link came back:\n{logs[1][-3000:]}"
    )
    assert "recovered" in out, out[-3000:]
    assert_same_losses(run_dir, gang_reference)
    assert_commits_verify(run_dir)
