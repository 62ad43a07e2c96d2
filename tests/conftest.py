import os

# JAX reads these when it is imported (xla.flags below imports it), so they are set first.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Identical programs recur across tests (same model, same shapes): share compiled executables.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from tests.support import xla  # noqa: E402

# Tests simulate slices as host devices; must be set before JAX initialises its backend.
# Eigen's intra-op threads off, as in worker processes: the in-process and multi-process
# runtimes then run the same programs with the same threading and agree bitwise. XLA:CPU's
# fast-compile settings (tests/support/xla.py says which, why and what they leave unchanged).
os.environ.setdefault("XLA_FLAGS", xla.flags(8))
# Ray's token authentication off for every Ray cluster the tests start (loopback only; see
# README's Ray section). One setting for the whole process: Ray reads the mode into its
# per-process config at the first ray.init, so a module that changed it for its own cluster
# left the next module's local cluster started in token mode and this process unable to
# speak to it (InvalidAuthToken), and a driver joined in the other mode saw its actors die.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


# -- the uninterrupted runs every fault test compares against (tests/support/recovery_runs.py) ----
# Session-scoped: five modules compare against the same run, which is deterministic (the
# in-process runtime, a fixed seed and data), so computing it once loses nothing.
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    from mpmd.runtime.control.inprocess import InProcessCluster  # after the XLA flags above
    from tests.support import recovery_runs

    with recovery_runs.make_trainer(InProcessCluster(), tmp_path_factory.mktemp("ref")) as trainer:
        losses, params, _ = recovery_runs.train(trainer, recovery_runs.data())
    return losses, params


@pytest.fixture(scope="session")
def uninterrupted_spin(tmp_path_factory):
    """phase -> the uninterrupted run of the pipeline spinning in that phase (computed once)."""
    from mpmd.runtime.control.inprocess import InProcessCluster  # after the XLA flags above
    from tests.support import recovery_runs

    runs = {}

    def get(phase):
        if phase not in runs:
            ref_dir = tmp_path_factory.mktemp("ref_spin")
            with recovery_runs.make_trainer(InProcessCluster(), ref_dir, recovery_runs.SPIN[phase]) as trainer:
                losses, params, _ = recovery_runs.train(trainer, recovery_runs.data(), steps=recovery_runs.SPIN_STEPS)
            runs[phase] = losses, params
        return runs[phase]

    return get


@pytest.fixture(scope="session")
def uninterrupted_data2(tmp_path_factory):
    """The uninterrupted run of recovery_runs' pipeline with every slice's mesh on data=2, for
    its GANG_STEPS steps: (losses, params). The gang tests (local and Ray) lose a process of one
    gang in it, once recovering from the persistent tier and once from the in-memory one; the
    tiers change nothing computed, so each is held to this one run."""
    from mpmd.runtime.control.inprocess import InProcessCluster  # after the XLA flags above
    from tests.support import recovery_runs

    with recovery_runs.make_trainer(
        InProcessCluster(), tmp_path_factory.mktemp("ref_data2"), mesh={"data": 2}
    ) as trainer:
        return recovery_runs.train(trainer, recovery_runs.data(), steps=recovery_runs.GANG_STEPS)[:2]


# -- the small GPT of the mesh tests (tests/runtime/test_mesh_slices.py), unpipelined and on workers ----
@pytest.fixture(scope="session")
def unpipelined_gpt():
    """The small GPT trained unpipelined, the reference of every mesh and gang run: (losses,
    first-step gradients, final parameters)."""
    from mpmd import models
    from tests.runtime.test_mesh_slices import data, make_gpt, sgd
    from tests.support import reference

    return reference.train(make_gpt, models.lm_loss, data(), sgd(), max_grad_norm=1.0)


@pytest.fixture(scope="session")
def two_device_workers():
    """run(mesh, schedule[, fsdp_gather]) -> (the small GPT's run on mesh: test_mesh_slices.run's
    result, the RPCs it took by verb) on one LocalCluster of 2 workers x 2 devices, each run made once per
    session: the mesh tests hold it to the in-process runtime, the gang tests to gangs of 2
    processes x 1 device."""
    import mpmd
    from tests.runtime.test_mesh_slices import run
    from tests.support.processes import wait_gone

    cluster = mpmd.LocalCluster(num_workers=2, devices_per_worker=2)
    runs = {}

    def get(mesh, schedule, fsdp_gather="per_microbatch"):
        key = repr((mesh, schedule, fsdp_gather))
        if key not in runs:
            before = dict(cluster.rpc_counts)
            got = run(cluster, mesh, schedule, close=False, fsdp_gather=fsdp_gather)
            took = {
                k: n - before.get(k, 0)
                for k, n in cluster.rpc_counts.items()
                if k not in ("Heartbeat", "Shutdown") and n != before.get(k, 0)
            }
            runs[key] = got, took
        return runs[key]

    yield get
    pids = list(cluster.pids)
    cluster.close()
    assert wait_gone(pids) == [], "workers outlived their cluster"


# -- worker processes the fault tests share (tests/support/recovery_runs.py) ------------------------
@pytest.fixture(scope="session")
def _shared_workers(tmp_path_factory):
    """[the LocalCluster of two workers the fault tests share], confined to the session's
    temporary directory (every test's tmp_path lies under it). Starting two workers per test
    cost seconds each; a test kills one, the cluster replaces it, and the next Trainer starts
    the survivor and the replacement afresh (Cluster.start: nothing shipped survives). At the
    end no worker it started may be left."""
    import mpmd
    from tests.support.processes import wait_gone

    holder = [mpmd.LocalCluster(num_workers=2, root=str(tmp_path_factory.getbasetemp()))]
    yield holder
    pids = list(holder[0].pids)
    holder[0].close()
    assert wait_gone(pids) == [], "workers outlived their cluster"


@pytest.fixture
def workers(_shared_workers):
    """The shared LocalCluster, every worker alive and with its default timeouts; started
    anew (the old one closed) if a failed test left a worker dead or stopped."""
    import mpmd
    from tests.support.processes import alive, wait_gone

    cluster = _shared_workers[0]
    if not all(alive(p) and _running(p) for p in cluster.pids):
        pids = list(cluster.pids)
        cluster.close()
        assert wait_gone(pids) == [], "workers outlived their cluster"
        cluster = _shared_workers[0] = mpmd.LocalCluster(num_workers=2, root=cluster.launcher.root)
    yield cluster
    cluster.failure_timeout_s, cluster.step_timeout_s = 5.0, None  # LocalCluster's defaults


def _running(pid: int) -> bool:
    """Not stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t")


# -- worker processes with several devices each, for expert-parallel slices (tests/models/test_moe.py) --
@pytest.fixture(scope="session")
def multi_device_workers(tmp_path_factory):
    """get(devices_per_worker) -> a LocalCluster of two workers with that many host devices
    each, started on first use and shared for the session (a test that kills a worker leaves
    the cluster's replacement), confined to the session's temporary directory as the shared
    workers are; none may be left at the end."""
    import mpmd
    from tests.support.processes import wait_gone

    clusters = {}

    def get(devices_per_worker: int):
        if devices_per_worker not in clusters:
            clusters[devices_per_worker] = mpmd.LocalCluster(
                num_workers=2, devices_per_worker=devices_per_worker, root=str(tmp_path_factory.getbasetemp())
            )
        return clusters[devices_per_worker]

    yield get
    pids = [p for c in clusters.values() for p in c.pids]
    for cluster in clusters.values():
        cluster.close()
    assert wait_gone(pids) == [], "workers outlived their cluster"


# -- where the suite's time goes (tests/README.md, "Time") ------------------------------------------
def _cpu_s() -> float:
    """CPU seconds of this process and of its children reaped so far (user + system)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU seconds spent here (in the xdist worker that ran
    it) since the phase before ended, whichever test that was: load from other work changes
    it far less than the wall-clock duration."""
    outcome = yield
    now = _cpu_s()
    outcome.get_result().user_properties.append(("cpu_s", now - getattr(item.session, "_mpmd_cpu_mark", now)))
    item.session._mpmd_cpu_mark = now


def pytest_runtest_logreport(report):
    """With MPMD_TEST_TIMES=FILE, one line per test phase as it ends: seconds, phase, node id,
    CPU seconds (of the xdist worker that ran it and of the subprocesses it reaped in the
    phase; see pytest_runtest_makereport), written by the process that runs pytest, which
    xdist's workers report to, so once per phase; a run cut short by a timeout still leaves
    what it measured, which --durations and --junitxml, written at the end, do not."""
    path = os.environ.get("MPMD_TEST_TIMES")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        cpu = dict(report.user_properties).get("cpu_s", float("nan"))
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.nodeid}\t{cpu:.2f}\n")
