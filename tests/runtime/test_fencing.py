"""Fenced generations (runtime/worker/service.py, "Generations"): a call of an older generation
than the one a worker was admitted in is refused before its body is read, and a worker that
was declared lost and replaced but still runs (a zombie: SIGSTOPped during a save, SIGCONTed
once its replacement has committed that step) writes nothing the run commits, and leaves on
its own."""

import os
import signal
import time

import grpc
import pytest

import mpmd
from mpmd.runtime.control.rpc import WorkerError, call
from mpmd.runtime.wire import verbs
from mpmd.runtime.worker.slice_store import CheckpointStore
from tests.support.processes import StandaloneWorkers, logged_at
from tests.support.recovery_runs import STEPS, assert_commits_verify, assert_same_run, data, make_trainer, train

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # real worker processes (tests/README.md)

LEASE_S = 20.0  # the zombie's lease: long enough that it finishes its save once SIGCONTed


def _refusal(client, request, verb=None) -> str:
    with pytest.raises(WorkerError) as e:
        call(client, request, verb=verb)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
    return e.value.details


def test_a_call_of_an_older_generation_is_refused_and_changes_nothing(tmp_path):
    """A controller admits the worker in generation 3 (Setup). A client of generation 2 (a
    superseded controller) is refused for every verb, Setup included, naming both
    generations; generation 3 goes on being served, Hello reports it, and a Connect of
    generation 4 moves the worker on, after which generation 3 is refused in turn."""
    with StandaloneWorkers(tmp_path, 1, shared=False) as workers:
        new, old = workers.client(0), workers.client(0)
        new.generation, old.generation = 3, 2
        setup = verbs.Setup(0, "127.0.0.1", "ab" * 16)
        reply = call(new, setup)[0]
        why = _refusal(old, verbs.Empty(), verb="Heartbeat")
        assert "stale generation 2" in why and "generation 3" in why, why
        _refusal(old, setup)
        _refusal(old, verbs.Put("x", []))
        assert call(new, verbs.Empty(), verb="Heartbeat")[0].progress is not None
        assert call(old, verbs.Empty(), verb="Hello")[0].generation == 3  # Hello is never refused
        newer = workers.client(0)
        newer.generation = 4
        call(newer, verbs.Connect({"0": reply.transfer_address}))
        _refusal(new, verbs.Empty(), verb="Heartbeat")
        assert workers.logged(0, "refused Heartbeat") and workers.logged(0, "stale generation 3")
        for c in (new, old, newer):
            c.close()


def test_a_zombie_worker_writes_nothing_the_run_commits_and_leaves(tmp_path, uninterrupted):
    """Three hand-started workers (two slices and a spare) train with a checkpoint every 2
    steps. Slice 1's worker is SIGSTOPped just after its Save of step 4 was sent: declared
    lost, replaced by the spare, which replays and commits step 4 again. Then it is SIGCONTed
    and finishes its own write of step 4, into its generation's directory, which no manifest
    names. The run ends bitwise as an uninterrupted one; nothing in a committed part was
    written after its manifest; the zombie leaves on its own once its lease lapses."""
    with StandaloneWorkers(tmp_path, 3, shared=False, lease_s=LEASE_S) as workers:
        zombie = workers.procs[1]
        run_dir = workers.root / "run"
        cluster = mpmd.StaticCluster(workers.addresses, token=workers.token, failure_timeout_s=1.5)
        trainer = make_trainer(cluster, run_dir)
        stopped, resumed = [], []
        real_save = cluster.save

        def save(r, items, digests=True):
            real_save(r, items, digests)
            if r == 1 and not stopped and any(os.path.basename(os.path.dirname(d)) == "4" for d in items):
                os.kill(zombie.pid, signal.SIGSTOP)  # its write of step 4 is queued or under way
                stopped.append(sorted(items))

        cluster.save = save

        def fault(i, trainer):
            if i == STEPS - 1 and stopped and not resumed:
                deadline = time.monotonic() + 60
                while 6 not in (store := CheckpointStore(run_dir)).committed():
                    assert time.monotonic() < deadline, "step 6 was never committed"
                    time.sleep(0.05)
                live.update(leaf["part"] for leaf in store.manifest(4)["leaves"].values())
                resumed.append(time.time())
                os.kill(zombie.pid, signal.SIGCONT)

        live = set()  # the parts of step 4 as its replacement committed them
        try:
            got = train(trainer, data(), fault)
        finally:
            trainer.close()
        assert stopped and resumed, "the fault never fired"
        assert train.rewound, "slice 1 was never declared lost"
        assert_same_run(got[:2], uninterrupted)
        # The zombie leaves on its own: nobody calls it any more, so its lease lapses.
        assert zombie.wait(timeout=LEASE_S + 30) == 0
        log = workers.logs[1].read_text()
        assert "controller silent" in log

    # It was told to write step 4 where the run never commits: its own generation's directory,
    # not the one its replacement wrote and the manifest names (nor that one's Orbax temporary
    # directory). Once back, it wrote there (or failed to, its directory having been cleared).
    stale = os.path.basename(stopped[0][0])
    assert live and stale not in live and stale.split(".")[0] in {p.split(".")[0] for p in live}, (stale, live)
    after = [line for line in log.splitlines() if stale in line and logged_at(line) >= resumed[0] - 0.5]
    assert after, f"the zombie did nothing with {stale} once SIGCONTed:\n{log[-3000:]}"
    assert_commits_verify(run_dir, stale=[stopped[0][0]])
