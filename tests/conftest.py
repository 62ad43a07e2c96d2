import os

# Tests simulate slices as host devices; must be set before JAX initialises its backend.
# Eigen's intra-op threads off, as in worker processes: the in-process and multi-process
# runtimes then run the same programs with the same threading and agree bitwise.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Identical programs recur across tests (same model, same shapes): share compiled executables.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


# -- the uninterrupted runs every fault test compares against (tests/recovery_runs.py) ----
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from runtime.inprocess import InProcessCluster  # after the XLA flags above
    from tests import recovery_runs
    with recovery_runs.make_trainer(InProcessCluster(), tmp_path_factory.mktemp("ref")) as trainer:
        losses, params, _ = recovery_runs.train(trainer, recovery_runs.data())
    return losses, params


@pytest.fixture(scope="module")
def uninterrupted_spin(tmp_path_factory):
    """phase -> the uninterrupted run of the pipeline spinning in that phase (computed once)."""
    from runtime.inprocess import InProcessCluster  # after the XLA flags above
    from tests import recovery_runs
    runs = {}

    def get(phase):
        if phase not in runs:
            ref_dir = tmp_path_factory.mktemp("ref_spin")
            with recovery_runs.make_trainer(InProcessCluster(), ref_dir, recovery_runs.SPIN[phase]) as trainer:
                losses, params, _ = recovery_runs.train(trainer, recovery_runs.data(), steps=recovery_runs.SPIN_STEPS)
            runs[phase] = losses, params
        return runs[phase]
    return get


