"""Programs: what a slice can run. Shipped as data, never as Python code.

Two kinds:
- "exported": a function serialized with `jax.export` on the controller. The worker
  deserializes and compiles it; it needs none of the user's model code.
- "sleep": a synthetic program with a declared duration and output specs. It costs wall
  time without using the CPU, so a schedule can be replayed on the real runtime with
  recorded or declared task costs (a dry run), and scheduling fidelity can be measured on a
  machine whose cores would otherwise distort it.

A loaded program is called as `program(*bundles) -> tuple of bundles`, a bundle being a
tuple of arrays.

Custom calls. A StableHLO `custom_call` runs whatever native function is registered under
its target name in the worker: a host callback target (`jax.pure_callback`,
`jax.debug.callback`) would call into a Python object that does not exist there and crash
the worker. An exported program may only call the targets XLA and jaxlib themselves emit
for ordinary ops (ALLOWED_CUSTOM_CALLS); any other is refused at load, naming it. The
repo's own stage programs (GPT, MLP; sgd, adam, adamw; with clipping) contain none on CPU.
"""

from __future__ import annotations

import re
import time
from typing import Callable, NamedTuple

import jax
import numpy as np

from mpmd.runtime.wire import reshard
from mpmd.runtime.wire import format as wire
from mpmd.runtime.worker.instructions import Spec, layout_from_json, layout_to_json


class ProgramSpec(NamedTuple):
    kind: str  # "exported" | "sleep"
    data: bytes = b""  # jax.export serialization, for "exported"
    duration_s: float = 0.0  # for "sleep"
    outputs: tuple[tuple[Spec, ...], ...] = ()  # output bundle specs, for "sleep"


KINDS = ("exported", "sleep")
# The custom-call targets XLA/jaxlib emit for supported ops (jax.export's list of stable
# targets, less user kernels (tpu_custom_call, mosaic_gpu_v2) and calls into other runtimes
# (tf.call_tf_function)): sharding annotations, LAPACK / cuSOLVER / hipSOLVER linear
# algebra, GPU threefry, TPU linear algebra and top-k, dynamic-shape ops.
ALLOWED_CUSTOM_CALLS = re.compile(
    r"Sharding|SPMDFullToShardShape|SPMDShardToFullShape|annotate_device_placement|shape_assertion"
    r"|AllocateBuffer|ApproxTopK|Eigh|LuDecomposition|ProductOfElementaryHouseholderReflectors|Qr"
    r"|lapack_\w+_ffi|(cusolver|hipsolver)_\w+_ffi|cusparse_gtsv2_ffi|(cu|hip)_threefry2x32_ffi"
    r"|(cu|hip)_lu_pivots_to_permutation|stablehlo\.dynamic_\w+"
)
_CUSTOM_CALL = re.compile(r'stablehlo\.custom_call\s*@(?:"([^"]*)"|([\w.$-]+))|call_target_name\s*=\s*"([^"]*)"')
Program = Callable[..., tuple]


def exported(fn: Callable, *arg_specs, out_shardings=None) -> ProgramSpec:
    """Export `fn(*bundles) -> tuple of bundles` for the given abstract argument bundles.

    Shardings: an argument spec's `sharding` (a NamedSharding on an AbstractMesh of the
    slice's shape) is the layout the program takes; `out_shardings` (a prefix of the output
    tree; None: XLA chooses) the layouts it returns. The program is then for that mesh's
    number of devices, bound to concrete devices by `load`."""
    exp = jax.export.export(jax.jit(fn, out_shardings=out_shardings))(*arg_specs)
    return ProgramSpec("exported", data=bytes(exp.serialize()))


def sleep(duration_s: float, outputs: tuple[tuple[Spec, ...], ...] = ()) -> ProgramSpec:
    return ProgramSpec("sleep", duration_s=float(duration_s), outputs=tuple(outputs))


def load(spec: ProgramSpec, mesh: jax.sharding.Mesh) -> Program:
    """Turn a spec into a callable that runs on `mesh` (the slice's devices, laid out as the
    program was exported for). Raises ValueError on a bad spec."""
    if spec.kind == "exported":
        try:
            exp = jax.export.deserialize(bytearray(spec.data))
        except Exception as e:  # flatbuffers raises assorted errors on garbage
            raise ValueError(f"program data is not a valid jax.export serialization: {e}") from None
        check_custom_calls(exp.mlir_module())
        if not exp.out_avals and exp.nr_devices == 1:
            # Nothing out and nothing used: jax.export drops an unused argument's sharding and
            # counts one device (opt_init of a stateless optimizer, plain optax.sgd, on a
            # 2-device slice). A pure program with no outputs has nothing to run.
            nothing = jax.tree.unflatten(exp.out_tree, [])
            return lambda *_bundles: nothing
        if exp.nr_devices != mesh.size:
            raise ValueError(f"program was exported for {exp.nr_devices} device(s); this slice has {mesh.size}")
        # The output layouts pin the devices (a program without inputs would otherwise run on
        # the process's first devices, not this slice's); inputs come committed to the mesh.
        outs = jax.tree.unflatten(exp.out_tree, exp.out_shardings_jax(mesh))
        return jax.jit(exp.call, out_shardings=outs)
    if spec.kind == "sleep":
        if not 0 <= spec.duration_s < float("inf"):
            raise ValueError(f"sleep program needs a finite duration_s >= 0, got {spec.duration_s}")
        for bundle in spec.outputs:
            check_specs(bundle, "sleep program output")
        # Outputs are made once: a synthetic program's outputs carry no information.
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        outs = tuple(
            tuple(reshard.place(np.zeros(s.shape, wire.numpy_dtype(s.dtype)), replicated) for s in bundle)
            for bundle in spec.outputs
        )

        def run(*_bundles):
            time.sleep(spec.duration_s)
            return outs

        return run
    raise ValueError(f"unknown program kind {spec.kind!r}; allowed: {', '.join(KINDS)}")


def signature(bundles) -> list:
    """The argument bundles of a program call as JSON: per bundle, per array [shape, dtype,
    layout (its PartitionSpec on the slice's mesh as instructions.layout_to_json; None: not
    laid out by name), weak type]: what a jit keys its executables on, so a hot spare can
    compile for exactly the calls a slice made (warm)."""
    return [
        [
            [
                list(a.shape),
                str(a.dtype),
                layout_to_json(tuple(a.sharding.spec)) if isinstance(a.sharding, jax.sharding.NamedSharding) else None,
                bool(getattr(a, "weak_type", False)),
            ]
            for a in bundle
        ]
        for bundle in bundles
    ]


def warm(program: Program, spec: ProgramSpec, mesh: jax.sharding.Mesh, signatures=None) -> int:
    """Compile a loaded program ahead of its first real call (a hot spare: Warm): call it on
    zeros for each of `signatures` (as `signature` gives them: the calls a slice compiled
    for), or with none given, once laid out as it was exported to take its arguments
    (unsharded ones replicated), every array committed to `mesh` as the executor commits
    its buffers, so the jit holds the executables a run's calls look up. The calls made
    ("sleep" and no-output programs have nothing to compile: 0)."""
    if spec.kind != "exported":
        return 0
    exp = jax.export.deserialize(bytearray(spec.data))
    if not exp.out_avals and exp.nr_devices == 1:
        return 0
    sharding = lambda layout: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*layout))
    if not signatures:
        shardings = [s if s is not None else sharding(()) for s in exp.in_shardings_jax(mesh)]
        flat = [reshard.place(np.zeros(a.shape, a.dtype), s) for a, s in zip(exp.in_avals, shardings)]
        args, kwargs = jax.tree.unflatten(exp.in_tree, flat)
        jax.block_until_ready(program(*args, **kwargs))
        return 1
    for bundles in signatures:
        args = [
            tuple(
                _zeros(shape, dtype, sharding(layout_from_json(layout) if layout is not None else ()), weak)
                for shape, dtype, layout, weak in bundle
            )
            for bundle in bundles
        ]
        jax.block_until_ready(program(*args))
    return len(signatures)


def _zeros(shape, dtype: str, sharding, weak: bool) -> jax.Array:
    """Zeros of a signature's array committed to `sharding`, weakly typed where it was (a
    value born of a Python scalar): made by a jit of lax.full, which every process of a gang
    runs alike, so the array is the gang's."""
    np_dtype = wire.numpy_dtype(dtype)
    scalar = {"i": 0, "f": 0.0, "c": 0j}.get(np_dtype.kind) if weak else None
    if scalar is not None and jax.numpy.result_type(scalar) == np_dtype:
        return jax.jit(lambda: jax.lax.full(tuple(shape), scalar), out_shardings=sharding)()
    return reshard.place(np.zeros(tuple(shape), np_dtype), sharding)


# The largest array a spec from the network may ask a worker to make or receive: XLA aborts
# the whole process on a shape whose size overflows, so it is checked here first.
MAX_ARRAY_BYTES = 2**40


def check_specs(specs, what: str) -> None:
    """ValueError unless every Spec has non-negative integer dims, a known dtype, and at most
    MAX_ARRAY_BYTES."""
    for s in specs:
        try:
            itemsize = wire.numpy_dtype(s.dtype).itemsize
        except TypeError:
            raise ValueError(f"{what}: unknown dtype {s.dtype!r}") from None
        if not all(isinstance(d, int) and d >= 0 for d in s.shape):
            raise ValueError(f"{what}: shape must be non-negative integers, got {s.shape!r:.100}")
        if itemsize * int(np.prod([int(d) for d in s.shape], dtype=object)) > MAX_ARRAY_BYTES:
            raise ValueError(f"{what}: {s.dtype}{list(s.shape)} is larger than {MAX_ARRAY_BYTES} bytes")


def check_custom_calls(mlir_text: str) -> None:
    """ValueError naming the first custom-call target outside ALLOWED_CUSTOM_CALLS."""
    for m in _CUSTOM_CALL.finditer(mlir_text):
        target = next(t for t in m.groups() if t is not None)
        if not ALLOWED_CUSTOM_CALLS.fullmatch(target):
            raise ValueError(
                f"program calls custom-call target {target!r}, which workers refuse: only "
                f"targets XLA emits for ordinary ops are allowed (no host callbacks)"
            )
