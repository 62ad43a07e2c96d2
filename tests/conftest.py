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
