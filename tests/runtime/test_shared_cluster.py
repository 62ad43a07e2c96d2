"""A shared cluster (`mpmd cluster up`), end to end through the real CLI: one manager and two
`mpmd worker --shared` processes, reused by every test of this module, and `mpmd train` jobs
with cluster.backend=shared as real subprocesses (tests/support/processes.Controller).

What would break if the feature broke: sharing jobs' losses differ from the same job alone;
a queued job starts before the one ahead of it ends, or loses its place when the manager is
restarted; a SIGKILLed job's sessions and memory stay on the workers or its workers never
come back to the pool; a repeated job compiles again; a lost worker is not replaced; a job
jumps the queue or shares a worker with an exclusive job; a job's credential stops the
cluster; `down` leaves a process; bad input is accepted. Last, a cluster of its own on Ray
(`--backend ray`), when Ray is installed.
"""

import collections
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpmd.recipes import config
from mpmd.recipes.run import run_log
from mpmd.runtime.control.client import WorkerClient, WorkerError
from mpmd.runtime.wire.credentials import job_credential
from mpmd.runtime.wire.tls import load
from mpmd.runtime.launchers.shared import MANAGER_SERVICE, JobRefused, SharedLauncher
from tests.support.processes import ROOT, Controller, alive, processes_tagged, wait_gone

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)

LEASE_S = 5.0  # short, for a fast cleanup check; long enough for a loaded machine
JOB = [
    "configs/gpt_tiny.yaml",
    "model.d_model=32",
    "model.num_layers=2",
    "model.seq_len=16",
    "train.batch_size=8",
    "train.steps=4",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "checkpoint.every=0",
    "log.progress=lines",
    "log.every=1",
    "log.trace_steps=[]",
    "log.tensorboard=false",
    "data.max_bytes=300000",
    "cluster.backend=shared",
    f"cluster.lease_s={LEASE_S}",
]


TAG = "MPMD_TEST_SHARED_CLUSTER"  # marks every process a cluster starts (inherited env)


def cluster(*args, timeout=120, tag="module"):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{TAG: tag})
    return subprocess.run(
        [sys.executable, "-m", "mpmd.recipes.cli", "cluster", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Shared:
    """The module's cluster: its file, its processes' pids, and Status."""

    def __init__(self, tmp: Path):
        self.tmp, self.file = tmp, tmp / "cluster.json"
        up = cluster(
            "up", "--workers", 2, "--dir", tmp / "cl", "--file", self.file, "--root", tmp, "--lease-s", LEASE_S
        )
        assert up.returncode == 0, up.stdout + up.stderr
        assert "cluster up: manager" in up.stdout
        self.saved = json.loads(self.file.read_text())

    def pids(self) -> list[int]:
        saved = json.loads(self.file.read_text())
        return [saved["manager_pid"]] + [w["pid"] for w in saved["workers"]]

    def status(self) -> dict:
        return status_of(self.file)

    def job(self, name: str, *overrides, share=True) -> Controller:
        return Controller(self.tmp / name, [*JOB, f"cluster.file={self.file}", f"cluster.share={share}", *overrides])

    def wait_for(self, what, timeout_s=30.0):
        return wait_for(self.file, what, timeout_s)


def status_of(file: Path) -> dict:
    out = cluster("status", "--file", file, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_for(file: Path, what, timeout_s=30.0) -> dict:
    """The first status for which what(status) holds (the workers' part is as of the
    manager's last health probe, every second)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = status_of(file)
        if what(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {json.dumps(status, indent=1)}")


def sessions(status: dict) -> list[list[str]]:
    """Per worker, the jobs it holds a session of."""
    return [sorted(x["job"] for x in w["sessions"]) for w in status["workers"]]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    s = Shared(tmp_path_factory.mktemp("shared"))
    yield s
    if s.file.exists():  # test_down did not run (or failed): stop it anyway
        cluster("down", "--file", s.file)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in run_log.read(run_dir)]


@pytest.mark.every_jax  # counts compiles of programs cached from another job
def test_sharing_jobs_match_the_job_alone_a_killed_one_is_cleaned_up_and_programs_are_cached(shared):
    """Jobs a (seed 0) and b (seed 1) alone, one after the other, then a, b and a third
    sharing job k at once on the same two workers; k is SIGKILLed after its first step. a
    and b finish with their losses bitwise those alone; within lease_s of the kill k's
    sessions are gone, its lease has expired, and the workers' memory is back to its level
    before the jobs. b alone, the second run of the same programs (the seed is an input, not
    part of a program), compiles nothing: every program comes from the workers' cache."""
    alone, first_step, compiled = {}, {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        before = [w["cache"] for w in shared.status()["workers"]]
        shared.job(f"{name}_alone", f"seed={seed}").succeed()
        after = [w["cache"] for w in shared.status()["workers"]]
        compiled[name] = [{k: x[k] - y[k] for k in ("hits", "misses")} for x, y in zip(after, before)]
        alone[name] = losses(shared.tmp / f"{name}_alone")
        first_step[name] = run_log.read(shared.tmp / f"{name}_alone")[0]["step_s"]
    print(
        f"first step: {first_step['a']:.3f} s (programs compiled), {first_step['b']:.3f} s (from the cache); "
        f"cache hits/misses per worker: first run {compiled['a']}, second run {compiled['b']}"
    )
    assert all(d["misses"] > 0 for d in compiled["a"]) and all(
        d["misses"] == 0 and d["hits"] > 0 for d in compiled["b"]
    ), compiled
    assert alone["a"] != alone["b"]  # else a mix-up between the two could not show
    idle = shared.wait_for(lambda s: not any(w["sessions"] for w in s["workers"]))
    before = [w["live_bytes"] for w in idle["workers"]]
    jobs = {
        name: shared.job(name, f"seed={seed}", "train.steps=1000" if name == "k" else "train.steps=4")
        for name, seed in (("a", 0), ("b", 1), ("k", 2))
    }
    jobs["k"].wait_for_step(1)
    k_id = {j["name"]: j["job"] for j in shared.status()["jobs"]}["k"]
    jobs["k"].proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for name in ("a", "b"):
        jobs[name].succeed()
        assert losses(shared.tmp / name) == alone[name], name
    # Sessions, lease and live bytes are waited for together: a probe may see the sessions gone
    # a moment before the last freed buffer (a leak still fails: the bytes never come back).
    back = lambda s: all(abs(w["live_bytes"] - b) <= 0.1 * max(b, 1) for w, b in zip(s["workers"], before))
    status = shared.wait_for(
        lambda s: (
            not any(w["sessions"] for w in s["workers"])
            and back(s)
            and {j["job"]: j["state"] for j in s["jobs"]}[k_id] == "expired"
        ),
        timeout_s=2 * LEASE_S,
    )
    print(
        f"killed job's sessions gone and lease expired, seen {time.monotonic() - killed_at:.1f} s after the "
        f"kill (first looked once a and b had finished; lease_s={LEASE_S:g})"
    )
    for w, b in zip(status["workers"], before):
        assert abs(w["live_bytes"] - b) <= 0.1 * max(b, 1), (w["live_bytes"], b)


@pytest.mark.platform
def test_without_share_a_job_waits_in_the_queue_across_a_manager_restart(shared):
    """x holds both workers; y queues at position 1 (printed). The manager is SIGKILLed and
    started again from the cluster file: it rebuilds x's lease and y's place from its workers
    and journal, and x goes on, even through the loss of a worker (SIGKILL), which the new
    manager restarts for it. y starts only once x (SIGTERMed: it checkpoints and exits 143) has
    released the workers."""
    first = shared.job("x", "train.steps=100000", "checkpoint.every=5", share=False)
    first.wait_for_step(1)
    second = shared.job("y", share=False)
    shared.wait_for(lambda s: any(j["name"] == "y" and j["state"] == "queued" for j in s["jobs"]))
    manager = json.loads(shared.file.read_text())["manager_pid"]
    os.kill(manager, signal.SIGKILL)
    assert wait_gone([manager]) == []
    again = cluster("up", "--rejoin", "--file", shared.file)
    assert again.returncode == 0, again.stdout + again.stderr
    status = shared.status()
    jobs = {j["name"]: j for j in status["jobs"]}
    assert jobs["x"]["state"] == "leased" and jobs["y"]["state"] == "queued" and jobs["y"]["position"] == 1, jobs
    at = len(run_log.read(shared.tmp / "x"))
    first.wait_for_step(at + 2)  # x still trains under the new manager
    # A worker lost under x: x asks the (restarted) manager for Replace, which restarts that
    # worker in its slot, and x recovers from its last checkpoint and goes on.
    lost = json.loads(shared.file.read_text())["workers"][1]["pid"]
    os.kill(lost, signal.SIGKILL)
    shared.wait_for(lambda s: s["workers"][1]["pid"] != lost and s["workers"][1]["health"] == "ok")
    first.wait_for_step(len(run_log.read(shared.tmp / "x")) + 2)
    first.proc.send_signal(signal.SIGTERM)
    rc, out = first.finish()
    assert rc == 143 and "recovered from slice 1" in out, out
    second.succeed()
    assert "waiting for the shared cluster: position 1 in its queue" in second.stderr_path.read_text()
    jobs = {j["name"]: j for j in shared.status()["jobs"]}
    assert jobs["x"]["state"] == jobs["y"]["state"] == "released"
    assert jobs["y"]["leased_at"] >= jobs["x"]["ended_at"]


@pytest.mark.platform
def test_placement_is_strict_fifo_gang_and_sharing_jobs_share_only_with_sharing_jobs(shared):
    """Leases asked of the real manager directly (no controllers; each lease opens the job's
    session on its workers). e1 takes one worker exclusively; s1 (sharing, 2 slices) waits for
    it; s2 (sharing, 1 slice), which would fit on the free worker, waits behind s1: nobody
    jumps the queue. e1's release starts s1 on both workers and s2 beside it on one. Once s1
    goes, e2 (exclusive) takes the worker s2 does not use; e3 (exclusive) and then s3
    (sharing, which s2's worker would take) wait in that order."""
    saved = json.loads(shared.file.read_text())
    clients = []

    def call(token, method, header):
        c = WorkerClient(saved["manager"], token, collections.Counter(), MANAGER_SERVICE, load(saved["tls"]))
        clients.append(c)
        return c.call(method, header)[0]

    def submit(name, slices, share):
        h = call(
            saved["submit_token"],
            "Submit",
            {"name": name, "slices": slices, "share": share, "root": str(shared.tmp / name)},
        )
        return {"job": h["job"], "credential": h["credential"], "position": h["position"]}

    def wait(job):
        return call(job["credential"], "Wait", {"job": job["job"]})

    def release(job):
        call(job["credential"], "Release", {"job": job["job"]})

    try:
        e1 = submit("e1", 1, False)
        s1, s2 = submit("s1", 2, True), submit("s2", 1, True)
        assert (e1["position"], s1["position"], s2["position"]) == (0, 1, 2)
        release(e1)
        assert wait(s1)["position"] == 0 and len(wait(s2)["workers"]) == 1
        shared.wait_for(
            lambda s: sorted(j for w in sessions(s) for j in w) == sorted([s1["job"], s1["job"], s2["job"]])
        )
        release(s1)
        e2 = submit("e2", 1, False)
        assert e2["position"] == 0 and wait(e2)["workers"] != wait(s2)["workers"]
        e3, s3 = submit("e3", 1, False), submit("s3", 1, True)
        assert (e3["position"], s3["position"]) == (1, 2)
        release(s2)
        assert wait(e3)["position"] == 0 and wait(s3)["position"] == 1
        release(e2)
        assert wait(s3)["position"] == 0
        for job in (e3, s3):
            release(job)
        assert shared.wait_for(lambda s: not any(w["sessions"] for w in s["workers"]))
    finally:
        for c in clients:
            c.close()


@pytest.mark.platform
def test_bad_input_is_refused_with_what_is_allowed(shared, tmp_path):
    def problems(*overrides):
        with pytest.raises(config.ConfigError) as e:
            config.load("configs/gpt_tiny.yaml", ["cluster.backend=shared", *overrides])
        return str(e.value)

    assert "not both" in problems("cluster.file=f.json", "cluster.address=127.0.0.1:5000")
    assert "cluster.token_file" in problems("cluster.address=127.0.0.1:5000")
    assert "lease_s" in problems("cluster.lease_s=0.5")
    assert "only used by cluster.backend='shared'" in str(
        pytest.raises(config.ConfigError, config.load, "configs/gpt_tiny.yaml", ["cluster.share=true"]).value
    )
    for args, says in (
        (["up", "--workers", "0"], "argument --workers: must be a whole number > 0, got '0'"),
        (["up"], "--workers N is needed"),
        (["up", "--workers", "2", "--backend", "slurm"], "allowed: local"),
        (["up", "--workers", "2", "--listen", "nowhere"], "--listen must be HOST:PORT"),
        (["up", "--workers", "2", "--file", shared.file], "still runs"),
        (["status", "--file", tmp_path / "none.json"], "not found"),
    ):
        out = cluster(*args)
        assert out.returncode == 2 and says in out.stderr, (args, out.stderr)
    # A run_dir outside the cluster's root: the manager refuses the job, nothing starts.
    outside = Controller(tmp_path / "outside", [*JOB, f"cluster.file={shared.file}"])
    rc, _ = outside.finish()
    assert rc == 2 and "not below the cluster root" in outside.stderr_path.read_text()
    # The manager's own refusals, asked directly: more slices than workers, a wrong submit token.
    saved = json.loads(shared.file.read_text())
    with pytest.raises(JobRefused, match=r"'slices' must be an integer 1\.\.2"):
        SharedLauncher(saved["manager"], saved["submit_token"], tls=load(saved["tls"])).start(3, str(shared.tmp))
    with pytest.raises(JobRefused, match="UNAUTHENTICATED"):
        SharedLauncher(saved["manager"], "0" * 32, tls=load(saved["tls"])).start(1, str(shared.tmp))
    two_device_slices = SharedLauncher(saved["manager"], saved["submit_token"], tls=load(saved["tls"]))
    two_device_slices.devices = [2]
    with pytest.raises(JobRefused, match="give the job cluster.devices_per_worker=1"):
        two_device_slices.start(1, str(shared.tmp))
    assert not [j for j in shared.status()["jobs"] if j["state"] in ("queued", "leased")]


@pytest.mark.platform
def test_a_job_whose_root_overlaps_a_live_job_or_whose_lease_is_too_long_is_refused_at_submit(shared, tmp_path):
    """The manager checks a job's root against every live job's, whichever workers they are
    on and through symlinks: a run_dir that is a symlink into another job's checkpoints is
    refused at Submit, and `mpmd train` says why in one line. A lease longer than the
    cluster's --max-lease-s (60 s by default) is refused, naming the bound."""
    saved = json.loads(shared.file.read_text())
    holder = SharedLauncher(saved["manager"], saved["submit_token"], tls=load(saved["tls"]), name="holder")
    holder.start(1, str(shared.tmp / "holder"))
    try:
        (shared.tmp / "holder" / "checkpoints").mkdir(parents=True)
        link = shared.tmp / "link"
        link.symlink_to(shared.tmp / "holder" / "checkpoints")
        with pytest.raises(
            JobRefused, match=rf"'root' {shared.tmp}/holder/checkpoints overlaps job {holder.job}'s root"
        ):
            SharedLauncher(saved["manager"], saved["submit_token"], tls=load(saved["tls"])).start(1, str(link))
        (shared.tmp / "holder" / "config.yaml").write_text("seed: 0\n")  # the holder's own files
        (shared.tmp / "holder" / "checkpoints" / "5").mkdir()
        tree = lambda: {
            str(p.relative_to(shared.tmp / "holder")): (p.is_dir(), p.stat().st_mtime_ns, p.stat().st_size)
            for p in (shared.tmp / "holder").rglob("*")
        }
        before = tree()
        job = Controller(link, [*JOB, f"cluster.file={shared.file}"])
        rc, _ = job.finish()
        err = job.stderr_path.read_text().strip().splitlines()
        assert rc == 2 and len(err) == 1 and f"overlaps job {holder.job}'s root" in err[0], err
        # Refused before its controller read or wrote anything there: no probe, log or chmod.
        assert tree() == before
        with pytest.raises(
            JobRefused,
            match=r"'lease_s' must be a number of seconds in \(0, 60\] \(the cluster's "
            r"--max-lease-s",
        ):
            SharedLauncher(saved["manager"], saved["submit_token"], tls=load(saved["tls"]), lease_s=3600).start(
                1, str(shared.tmp / "long")
            )
    finally:
        holder.stop()
    assert not [j for j in shared.status()["jobs"] if j["state"] in ("queued", "leased")]


@pytest.mark.platform
def test_the_cluster_token_stays_with_the_manager_and_a_job_acts_on_itself_only(shared):
    """The cluster file (0600) holds the submit token, not the cluster token; a job's
    credential may not stop the cluster nor touch another job."""
    assert stat.S_IMODE(os.stat(shared.file).st_mode) == 0o600
    cluster_token = (shared.tmp / "cl" / "cluster.token").read_text().strip()
    assert cluster_token not in shared.file.read_text()
    saved = json.loads(shared.file.read_text())
    mine = WorkerClient(
        saved["manager"],
        job_credential(cluster_token, "mine-1"),
        collections.Counter(),
        MANAGER_SERVICE,
        load(saved["tls"]),
    )
    try:
        for method, header in (("Down", {}), ("Release", {"job": "theirs-1"}), ("Submit", {"slices": 1})):
            with pytest.raises(WorkerError, match="PERMISSION_DENIED"):
                mine.call(method, header)
    finally:
        mine.close()
    assert all(alive(p) for p in shared.pids())


@pytest.mark.every_jax  # no compile after a takeover (jax 0.12's weak types)
def test_a_hot_spare_leased_beside_a_slice_takes_it_over_and_is_leased_again(shared):
    """cluster.hot_spares=1, one slice: the job leases both workers, one as its warm spare.
    The worker serving the slice is SIGKILLed: the spare takes the slice over, the first step
    after compiles nothing, and the manager restarts the lost worker, which the job leases as
    its new spare. The losses are those of the same job without a spare, uninterrupted."""
    one = ["pipeline.num_stages=1", "train.steps=12", "checkpoint.memory_every=1"]
    ref = shared.job("hs_ref", *one, share=False)
    ref.succeed()
    job = shared.job("hs", *one, "cluster.hot_spares=1", "train.steps=100000", share=False)
    try:
        job.wait_for_step(2)
        status = shared.wait_for(lambda s: any(j["name"] == "hs" and j["state"] == "leased" for j in s["jobs"]))
        leased = next(j for j in status["jobs"] if j["name"] == "hs")["workers"]
        assert len(leased) == 2, leased  # the slice's worker, then the spare
        job_id = next(j for j in status["jobs"] if j["name"] == "hs")["job"]
        lost = status["workers"][leased[0]]["pid"]
        os.kill(lost, signal.SIGKILL)
        # Restarted by the manager, and leased to the job again as its spare (its session there).
        shared.wait_for(lambda s: s["workers"][leased[0]]["pid"] != lost and job_id in sessions(s)[leased[0]], 60)
        job.wait_for_step(len(run_log.read(shared.tmp / "hs")) + 12)
        job.proc.send_signal(signal.SIGTERM)
        rc, out = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert rc == 143 and "recovered from slice 0" in out, out
    records = run_log.read(shared.tmp / "hs")
    after = next(r for r in records if "recovered" in r)
    assert "compiles" not in after, after
    assert losses(shared.tmp / "hs")[:12] == losses(shared.tmp / "hs_ref")
    # Released with the job: no session of it is left on the workers.
    shared.wait_for(lambda s: not any(job_id in x for x in sessions(s)), timeout_s=30)


@pytest.mark.platform
def test_down_while_a_job_trains_ends_the_job_in_one_line_and_leaves_no_process(shared):
    """`mpmd cluster down` under a training job: the manager refuses the job's Replace for
    the workers it stops, so no new worker starts; `down` returns once every process is
    gone and only then removes the cluster file; the job ends within seconds with one line
    naming its last committed step. The job runs one slice and a hot spare on the two
    workers: `down` leaves no spare running either."""
    job = shared.job(
        "d", "train.steps=100000", "checkpoint.every=2", "pipeline.num_stages=1", "cluster.hot_spares=1", share=False
    )
    try:
        job.wait_for_step(3)
        job.wait_for_commit()
        pids = shared.pids()
        assert all(alive(p) for p in pids) and set(pids) <= set(processes_tagged(TAG, "module"))
        out = cluster("down", "--file", shared.file)
        assert out.returncode == 0, out.stderr
        assert wait_gone(pids, 5.0) == []
        assert wait_gone(processes_tagged(TAG, "module"), 5.0) == []
        assert not shared.file.exists()
        rc, _ = job.finish(timeout_s=30)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    from mpmd.runtime.worker.slice_store import CheckpointStore

    last = CheckpointStore(shared.tmp / "d").committed()[-1]
    err = job.stderr_path.read_text().strip().splitlines()
    assert rc == 1 and err[-1] == (
        f"error: the shared cluster was shut down; last committed checkpoint: step {last}"
    ), err[-5:]


@pytest.mark.platform
def test_a_ray_backed_cluster_leases_its_actors_and_down_leaves_no_process(tmp_path):
    """`--backend ray`: the workers are Ray actors of a Ray instance the manager starts. A
    job's lease opens its session on them and its release closes it; `down` stops the
    actors, Ray's own processes and the manager."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
    file = tmp_path / "ray.json"
    up = cluster(
        "up",
        "--backend",
        "ray",
        "--workers",
        2,
        "--dir",
        tmp_path / "cl",
        "--file",
        file,
        "--root",
        tmp_path,
        tag="ray",
    )
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        saved = json.loads(file.read_text())
        assert saved["backend"] == "ray" and len(saved["workers"]) == 2
        job = SharedLauncher(saved["manager"], saved["submit_token"], tls=load(saved["tls"]), name="on-ray")
        addresses = job.start(2, str(tmp_path / "run"))
        assert sorted(addresses) == sorted(w["address"] for w in saved["workers"])
        wait_for(file, lambda s: sessions(s) == [[job.job]] * 2)
        job.stop()
        status = wait_for(file, lambda s: sessions(s) == [[], []])
        assert all(w["cache"] is not None and w["live_bytes"] is not None for w in status["workers"])
    finally:
        out = cluster("down", "--file", file, tag="ray")
    assert out.returncode == 0, out.stderr
    assert wait_gone(processes_tagged(TAG, "ray"), 10.0) == []
