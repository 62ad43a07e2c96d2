"""The XLA flags of every JAX process the tests start: this one (tests/conftest.py) and the
controllers and workers it launches (tests/support/processes.py, tests that build a
subprocess's environment), so that a run here and the same run in a subprocess compile the
same code and agree bitwise.

XLA_CPU_COMPILE_FAST makes XLA:CPU compile fast rather than compile fast code: LLVM at -O0
(`--xla_backend_optimization_level=0`) and the elemental IR emitter for fused kernels
(`--xla_cpu_use_fusion_emitters=false`) instead of the MLIR fusion emitters. The suite
compiles hundreds of small stage programs of ~100 fused kernels each, every one from scratch
on a clean checkout (the persistent compilation cache starts empty), and at XLA's defaults
compiling took most of its time. Measured (CPU seconds, user, cold cache, 2026-12-04):
tests/stages/test_marks.py + tests/train/test_workloads.py 245 at the defaults, 208 with -O0
alone, 151 with both (-38 %); the flags' effect on one equivalence test is the same in
kind. XLA's HLO optimisations (fusion decisions, layouts, SPMD partitioning) are the same
at every setting; the kernels' machine code differs. What the tests assert (pipelined
equals unpipelined to 1e-5, one process equals another bitwise, a resumed run its
uninterrupted one) compares programs compiled alike, so it holds under either. Benchmarks
and real runs keep XLA's defaults: nothing outside tests/ sets these. jaxlib 0.11 removed the
second flag (`mpmd.runtime.compat.XLA_CPU_COMPILE_FAST` holds what each version takes), so
there -O0 is the whole of it.
"""

SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def flags(devices: int | None = None, *, eigen_threads: bool = False) -> str:
    """XLA_FLAGS for a test process: the compile-fast flags, `devices` host devices (None: XLA's default
    of one), Eigen's intra-op threads off unless `eigen_threads`."""
    parts = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    from mpmd.runtime import compat  # imports jax: here, so that conftest sets JAX's environment first

    parts += [] if eigen_threads else [SINGLE_THREAD]
    return " ".join(parts + [compat.XLA_CPU_COMPILE_FAST])
