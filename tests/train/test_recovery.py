"""Fault injection with real worker processes and real signals.

Every scenario ends with exactly the parameters of an uninterrupted run (bitwise: the
in-process and multi-process runtimes run the same programs with the same threading) and
leaves no process behind.
"""

import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest

import mpmd
from tests.support import reference
from tests.support.processes import alive, wait_gone
from tests.support.recovery_runs import (
    EVERY,
    SPIN,
    SPIN_STEPS,
    STEPS,
    assert_same_run,
    data,
    kill_once,
    make_trainer,
    run_with_fault,
    slice_part,
    train,
)

pytestmark = [pytest.mark.slow, pytest.mark.every_jax]  # worker processes or a controller (tests/README.md)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used, all threads (fields 14, 15 of /proc/pid/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuLog:
    """(wall ns, pid, CPU s) of slice `slice_index`'s current worker, sampled every ~2 ms."""

    def __init__(self, cluster, slice_index: int):
        self.samples: list[tuple[int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(cluster, slice_index), daemon=True)
        self._thread.start()

    def _run(self, cluster, slice_index):
        while not self._stop.wait(0.002):
            try:
                pid = cluster.pids[slice_index]
                self.samples.append((time.time_ns(), pid, cpu_s(pid)))
            except (OSError, ValueError, IndexError):  # no worker yet, or it just died
                pass

    def at(self, pid: int, t_ns: int) -> float:
        """The CPU time of `pid` at wall time `t_ns` (its last sample before then)."""
        before = [c for t, p, c in self.samples if p == pid and t <= t_ns]
        assert before, f"no CPU sample of pid {pid} before {t_ns}"
        return before[-1]

    def close(self):
        self._stop.set()
        self._thread.join()


def phase_window(trace, phase: str, slice_index: int) -> tuple[int, int]:
    """(first start, last end) wall ns of slice `slice_index`'s tasks of `phase` ("F" forward,
    "B" backward) in one traced step."""
    _, _, pid, events = trace
    mine = [e for e in events[slice_index] if e.kind == "run" and e.name.startswith(phase + " ")]
    assert mine, f"no {phase} tasks traced on slice {slice_index}: {[e.name for e in events[slice_index]]}"
    return min(e.start_ns for e in mine), max(e.end_ns for e in mine)


def phase_cpu(trace, phase: str, cpu: CpuLog, slice_index: int = 1) -> tuple[float, float]:
    """The CPU seconds slice `slice_index`'s worker had used since the step was sent, when its
    `phase` began and when it ended, in one traced step."""
    _, start_ns, pid, _ = trace
    lo, hi = phase_window(trace, phase, slice_index)
    base = cpu.at(pid, start_ns)
    return cpu.at(pid, lo) - base, cpu.at(pid, hi) - base


def kill_in_phase(at_step, phase, traces, cpu: CpuLog, slice_index=1):
    """A fault that SIGKILLs slice `slice_index`'s worker while batch `at_step` is trained,
    once the worker has used, since the step was sent, the CPU time that lay in the middle
    of its `phase` in the traced step before (`fault.threshold_s`). A spinning phase is the
    only place a worker burns that much CPU, however loaded the machine is. `fault.offset_s`
    records the kill's wall-clock offset after the step was sent."""

    def fault(i, trainer):
        if i == at_step - 1 and trainer.checkpoints is not None:
            # The traced step before runs with no checkpoint write beside it in the worker
            # (writes run in the background), as the killed step and its replay do.
            trainer.checkpoints.wait()
        if i == at_step and not fault.fired:
            lo, hi = phase_cpu(traces[-1], phase, cpu, slice_index)
            fault.threshold_s = (lo + hi) / 2
            pid = trainer.cluster.pids[slice_index]
            fault.fired.append(pid)
            start_ns, base = time.time_ns(), cpu_s(pid)

            def kill():
                deadline = time.monotonic() + 60
                while cpu_s(pid) - base < fault.threshold_s and time.monotonic() < deadline:
                    time.sleep(0.001)
                fault.offset_s = (time.time_ns() - start_ns) / 1e9
                fault.reached = cpu_s(pid) - base >= fault.threshold_s
                os.kill(pid, signal.SIGKILL)

            threading.Thread(target=kill, daemon=True).start()

    fault.fired, fault.threshold_s, fault.offset_s, fault.reached = [], None, None, False
    return fault


@pytest.mark.parametrize("phase", ["F", "B"], ids=["forward", "backward"])
def test_worker_sigkilled_mid_step(uninterrupted_spin, workers, tmp_path, phase):
    """SIGKILL the last stage's worker inside its forward (or backward) phase of step 4.

    Under GPipe a slice runs all its forwards, then all its backwards; `Spin` makes the phase
    under test burn ~0.8 s of CPU on slice 1 and leaves the other phase cheap. The kill waits
    for the worker to have used the CPU that, in the traced step before, it had used in the
    middle of that phase. Where the mark fell in the step before and in the replayed step is
    printed, not asserted: the CPU a worker spends outside its programs (waiting, polling,
    gRPC) grows with the machine's load, so any margin would be a bound on the load."""
    at_step, traces = SPIN_STEPS - 1, []
    cpu = CpuLog(workers, 1)
    try:
        fault = kill_in_phase(at_step, phase, traces, cpu)
        losses, params, rewinds = run_with_fault(tmp_path, fault, SPIN[phase], traces, workers, SPIN_STEPS)
    finally:
        cpu.close()
    assert rewinds == 1
    before = next(t for t in traces if t[0] == at_step - 1)
    replayed = [t for t in traces if t[0] == at_step][-1]
    assert before[2] != replayed[2], "the replayed step should run on the replacement worker"
    assert fault.reached, "the kill came from the thread's deadline, not from the CPU mark"
    print(
        f"{phase}: killed after {fault.threshold_s:.3f} CPU s, {fault.offset_s * 1e3:.0f} ms into the step; "
        f"phase CPU windows (s) before/replayed: {[phase_cpu(t, phase, cpu) for t in (before, replayed)]}; "
        f"wall windows (ms): {[[round((x - t[1]) / 1e6) for x in phase_window(t, phase, 1)] for t in (before, replayed)]}"
    )
    assert_same_run((losses, params), uninterrupted_spin(phase))


def test_worker_sigkilled_during_async_save(uninterrupted, workers, tmp_path):
    def fault(i, trainer):
        # Batch i == EVERY * 2 comes right after the save of step 4 was started.
        if i == 2 * EVERY and not fault.fired:
            fault.fired.append(trainer.cluster.pids[0])
            os.kill(fault.fired[0], signal.SIGKILL)

    fault.fired = []
    losses, params, rewinds = run_with_fault(tmp_path, fault, cluster=workers)
    assert rewinds == 1
    assert_same_run((losses, params), uninterrupted)


def test_worker_lost_before_a_waited_save_commits(uninterrupted, workers, tmp_path):
    """A save waited for (the run's final one) whose step a lost slice keeps from committing
    (slice 1 SIGKILLed after its Save returned, before its parts were finalized) never returns
    as if saved: it raises Rewound to the last commit; replaying and saving again commits the
    final step, with the uninterrupted run's losses and parameters."""
    batches = data()
    cluster = workers
    trainer = make_trainer(cluster, tmp_path, checkpoint=mpmd.Checkpointing(every=3))  # commits steps 3 and 6, not 8
    wait_saves = cluster.wait_saves

    def killing_wait_saves(r, directories):
        if not killed:
            killed.append(cluster.pids[1])
            os.kill(killed[0], signal.SIGKILL)
        return wait_saves(r, directories)

    killed = []
    try:
        losses = {}
        for i in range(STEPS):
            losses[i + 1] = trainer.step(batches[i], batches[i], data_state={"i": i + 1})["loss"]
        trainer.checkpoints.wait()  # step 6 committed: only the final save meets the fault
        cluster.wait_saves = killing_wait_saves
        with pytest.raises(mpmd.Rewound) as rewound:
            trainer.save(data_state={"i": STEPS}, wait=True)
        del cluster.wait_saves
        assert killed and rewound.value.step == 6 and rewound.value.data_state == {"i": 6}
        assert trainer.checkpoints.latest() == 6, "step 8 was not committed"
        for i in range(6, STEPS):
            losses[i + 1] = trainer.step(batches[i], batches[i], data_state={"i": i + 1})["loss"]
        trainer.save(data_state={"i": STEPS}, wait=True)
        assert trainer.checkpoints.latest() == STEPS
        params = reference.stage_leaves(trainer.params())
    finally:
        cluster.__dict__.pop("wait_saves", None)
        trainer.close(close_cluster=False)
    assert killed and wait_gone(killed) == [] and all(alive(p) for p in cluster.pids)
    assert_same_run((losses, params), uninterrupted)


def test_worker_sigstopped_is_found_hung_and_replaced(uninterrupted, workers, tmp_path):
    """A SIGSTOPped worker is found hung by its heartbeat's probe (runtime/control/heartbeat.py),
    long before failure_timeout_s (30 s here), replaced, and the run ends as the uninterrupted one."""
    fault = kill_once(3, signal.SIGSTOP)
    workers.failure_timeout_s = 30.0  # the fixture puts the default back
    before, workers.probe_timeout_s = workers.probe_timeout_s, 0.3  # the default, whatever was set before
    try:
        losses, params, rewinds = run_with_fault(tmp_path, fault, cluster=workers)
    finally:
        workers.probe_timeout_s = before
        _kill_if_stopped(fault.fired)
    assert rewinds == 1
    # Declared lost by its probe, not by its silence (failure_timeout_s) nor the step watchdog.
    assert "lost: hung: its heartbeat unanswered for" in train.rewound[0], train.rewound
    assert "failure_timeout_s=30" not in train.rewound[0], train.rewound
    assert_same_run((losses, params), uninterrupted)


def test_busy_worker_is_not_declared_lost(uninterrupted, tmp_path, monkeypatch):
    """Both workers hold their GIL for 3 s in step 2 (failpoint busy: no RPC answered, the
    process running on): their heartbeats go unanswered far past the probes' suspicion, the
    probes find them busy, and no worker is lost; the run ends as the uninterrupted one."""
    monkeypatch.setenv("MPMD_FAILPOINTS", "transfer@6=busy:3")  # the workers started below inherit it
    losses, params, rewinds = run_with_fault(
        tmp_path,
        None,
        root=str(tmp_path),
        failure_timeout_s=30.0,
        log_dir=str(tmp_path / "logs"),
        probe_timeout_s=0.3,
    )
    assert rewinds == 0, train.rewound
    assert run_with_fault.trainer.cluster.heartbeats.busy > 0, "no probe found a worker alive but busy"
    logs = "".join(f.read_text() for f in (tmp_path / "logs").iterdir())
    assert "failpoint transfer reached (hit 6" in logs and "busy, holding the GIL, 3 s" in logs, logs[-2000:]
    assert_same_run((losses, params), uninterrupted)


def _kill_if_stopped(pids):
    """SIGKILL each of `pids` still alive and stopped (a test's SIGSTOPped worker that was not replaced)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stopped = f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except FileNotFoundError:
            continue
        if stopped:
            os.kill(pid, signal.SIGKILL)


def test_worker_sigtermed_is_a_lost_worker(uninterrupted, workers, tmp_path):
    """A worker's own preemption notice (SIGTERM, as a scheduler sends the host's processes)
    ends it like a SIGKILL would, from the controller's view: the slice is lost, replaced and
    restored, and the run ends as the uninterrupted one."""
    fault = kill_once(3, signal.SIGTERM)
    losses, params, rewinds = run_with_fault(tmp_path, fault, cluster=workers)
    assert rewinds == 1 and "slice 1" in train.rewound[0], train.rewound
    assert_same_run((losses, params), uninterrupted)


def test_newest_checkpoint_damaged_falls_back(uninterrupted, workers, tmp_path, caplog):
    """Resume with the newest step truncated, then with a stage directory deleted: each time
    the previous committed step is used, with a warning naming the damaged one."""
    with make_trainer(mpmd.InProcessCluster(), tmp_path, checkpoint=mpmd.Checkpointing(every=EVERY, keep=3)) as trainer:
        with pytest.raises(_Stop):
            train(trainer, data(), fault=_stop_after(6))
    ck = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in ck.iterdir()) == [2, 4, 6]
    # Truncate every data file of step 6's slice 0.
    for f in slice_part(ck / "6", 0).rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "d" in f.parts[-2:-1]:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    shutil.rmtree(slice_part(ck / "4", 1))
    with caplog.at_level("WARNING", logger="mpmd"):
        trainer = make_trainer(workers, tmp_path)
        try:
            assert trainer.resumed[0] == 2
            losses, params, _ = train(trainer, data())
        finally:
            trainer.close(close_cluster=False)
    assert "skipping checkpoint step 6" in caplog.text and "skipping checkpoint step 4" in caplog.text
    assert [s for s in losses] == list(range(3, STEPS + 1))
    assert losses == {s: l for s, l in uninterrupted[0].items() if s > 2}
    assert all(np.array_equal(a, b) for a, b in zip(params, uninterrupted[1]))


def _stop_after(n):
    def fault(i, trainer):
        if i == n:
            raise _Stop

    return fault


class _Stop(Exception):
    pass


def test_restart_budget_counts_only_recoveries_within_its_window(tmp_path):
    """max_restarts=1 per restart_window_s: a loss once the window has passed since the last
    recovery ended is recovered (that one no longer counts); one right after a recovery is one
    too many."""
    window_s = 3.0
    cluster = mpmd.LocalCluster()
    trainer = make_trainer(cluster, tmp_path, recovery=mpmd.Recovery(max_restarts=1, restart_window_s=window_s))
    try:
        batches = data()
        trainer.step(batches[0], batches[0])
        trainer.step(batches[1], batches[1], data_state={"i": 2})
        trainer.checkpoints.wait()
        for k in (1, 2):  # each loss recovered: the one before it fell out of the window
            os.kill(cluster.pids[1], signal.SIGKILL)
            with pytest.raises(mpmd.Rewound):
                trainer.step(batches[2], batches[2])
            time.sleep(window_s + 0.5)
            assert trainer.restarts == k
        trainer.step(batches[2], batches[2])
        os.kill(cluster.pids[1], signal.SIGKILL)
        with pytest.raises(mpmd.Rewound):
            trainer.step(batches[3], batches[3])
        os.kill(cluster.pids[1], signal.SIGKILL)  # within the window of the last recovery
        with pytest.raises(
            RuntimeError,
            match=r"giving up after 1 recoveries within 3 s "
            r"\(max_restarts=1, restart_window_s=3.0\); last committed",
        ):
            trainer.step(batches[3], batches[3])
    finally:
        pids = list(cluster.pids)
        trainer.close()
    assert wait_gone(pids) == []


def test_gives_up_after_max_restarts(tmp_path):
    cluster = mpmd.LocalCluster()
    trainer = make_trainer(cluster, tmp_path, recovery=mpmd.Recovery(max_restarts=0))
    try:
        batches = data()
        trainer.step(batches[0], batches[0])
        trainer.step(batches[1], batches[1], data_state={"i": 2})
        trainer.checkpoints.wait()
        os.kill(cluster.pids[1], signal.SIGKILL)
        with pytest.raises(
            RuntimeError, match=r"slice 1 .* lost.*giving up after 0 recoveries.*last committed checkpoint: step 2"
        ):
            trainer.step(batches[2], batches[2])
    finally:
        pids = list(cluster.pids)
        trainer.close()
    assert wait_gone(pids) == []


def test_goodput_counts_each_worker_lost_when_two_go_at_once(tmp_path):
    """Both workers killed together: one loss is declared, the other is found while the first
    is replaced or restored; goodput books two workers lost and the run goes on."""
    cluster = mpmd.LocalCluster()
    trainer = make_trainer(cluster, tmp_path)
    try:
        batches = data()
        trainer.step(batches[0], batches[0])
        trainer.step(batches[1], batches[1], data_state={"i": 2})
        trainer.checkpoints.wait()
        for pid in list(cluster.pids):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(mpmd.Rewound):
            trainer.step(batches[2], batches[2])
        assert trainer.goodput()["failures"] == 2
        assert trainer.restarts == 2
        trainer.step(batches[2], batches[2])
    finally:
        pids = list(cluster.pids)
        trainer.close()
    assert wait_gone(pids) == []
