"""A stage's state packed into one array per dtype and back (mpmd/train/packing.py), through
the exported programs a worker loads: bitwise for every dtype, shape and layout, on one device
and on meshes whose leaves are split, replicated or both; each byte packed once."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from mpmd.runtime import compat
from mpmd.runtime.wire import format as wire
from mpmd.runtime.worker import programs
from mpmd.runtime.worker.instructions import Spec
from mpmd.stages import sharding
from mpmd.train import packing

# Two bundles as a stage's p{k} and o{k} might be: float32 matrices split or replicated, a
# bfloat16 vector, an int32 scalar (an optimizer's count), an empty leaf, a float32 scalar
# and a leaf whose size no replica count divides (7 x 5 = 35 elements).
BUNDLES = (
    (
        Spec((4, 6), "float32", (None, "tensor")),
        Spec((), "int32"),
        Spec((3,), "bfloat16"),
        Spec((0, 5), "float32"),
        Spec((8, 3), "float32", (("data", "fsdp"),)),
        Spec((7, 5), "float32"),
    ),
    (
        Spec((4,), "int32", ("data",)),
        Spec((), "float32"),
        Spec((2, 2, 2), "bfloat16", (None, "fsdp")),
        Spec((6,), "bool"),
    ),
)
MESHES = [
    sharding.SliceMesh(),
    sharding.SliceMesh(data=2),
    sharding.SliceMesh(fsdp=2, tensor=2),
    sharding.SliceMesh(data=2, fsdp=2, tensor=2),
]


def _fit(spec: Spec, mesh: sharding.SliceMesh) -> Spec:
    """`spec` with the axes of size 1 on `mesh` dropped from its layout (as the planner lays
    leaves out) and the rest kept only where they divide."""
    sizes = dict(zip(sharding.AXES, mesh))
    layout = []
    for dim, entry in zip(spec.shape, spec.layout):
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,) if entry else ()) if sizes[a] > 1)
        ways = int(np.prod([sizes[a] for a in axes]))
        layout.append(None if not axes or dim % ways else axes[0] if len(axes) == 1 else axes)
    return spec._replace(layout=tuple(layout))


def _device_mesh(mesh: sharding.SliceMesh) -> jax.sharding.Mesh:
    return compat.mesh(np.asarray(jax.devices()[: mesh.size]).reshape(tuple(mesh)), sharding.AXES)


def _state(specs, devices: jax.sharding.Mesh, seed: int = 0) -> list[tuple[jax.Array, ...]]:
    rng = np.random.default_rng(seed)
    return [
        tuple(
            jax.device_put(
                (rng.standard_normal(s.shape) * 1e3).astype(wire.numpy_dtype(s.dtype)),
                NamedSharding(devices, PartitionSpec(*s.layout)),
            )
            for s in bundle
        )
        for bundle in specs
    ]


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


@pytest.mark.parametrize(
    "mesh", MESHES, ids=lambda m: "x".join(f"{a}{n}" for a, n in zip(sharding.AXES, m) if n > 1) or "one"
)
def test_pack_then_unpack_is_bitwise_through_the_exported_programs(mesh):
    specs = tuple(tuple(_fit(s, mesh) for s in bundle) for bundle in BUNDLES)
    layout = packing.packing(specs, mesh)
    devices = _device_mesh(mesh)
    pack, unpack = (programs.load(p, devices) for p in packing.exported(layout))
    state = _state(specs, devices)
    (packed,) = pack(*state)
    # One array per dtype, in order of first appearance, D rows split over every device.
    assert [str(a.dtype) for a in packed] == ["float32", "int32", "bfloat16", "bool"]
    assert [a.shape for a in packed] == [s.shape for s in layout.packed_specs]
    assert all(
        a.sharding.spec == PartitionSpec(sharding.AXES) and len(a.sharding.device_set) == mesh.size for a in packed
    )
    back = unpack(packed)
    for want_bundle, got_bundle in zip(state, back):
        assert len(got_bundle) == len(want_bundle)
        for want, got in zip(want_bundle, got_bundle):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (want.sharding, got.sharding)
            assert _bits(got) == _bits(want)


@pytest.mark.parametrize("mesh", MESHES[1:], ids=["data2", "fsdp2xtensor2", "data2xfsdp2xtensor2"])
def test_every_byte_is_packed_once(mesh):
    """A replicated leaf is cut among its holders, not packed by each: the packed arrays hold
    the state's elements plus at most (replicas - 1) of padding per leaf, every row alike."""
    specs = tuple(tuple(_fit(s, mesh) for s in bundle) for bundle in BUNDLES)
    layout = packing.packing(specs, mesh)
    sizes = dict(zip(sharding.AXES, mesh))
    state = sum(int(np.prod(s.shape)) * wire.numpy_dtype(s.dtype).itemsize for b in specs for s in b)
    padding = sum(
        (int(np.prod([sizes[a] for a in p.replicas])) - 1) * wire.numpy_dtype(s.dtype).itemsize
        for b, parts in zip(specs, layout.parts)
        for s, p in zip(b, parts)
    )
    assert state <= wire.nbytes(layout.packed_specs) <= state + padding
    assert layout.pieces == (mesh.size,) * len(layout.dtypes)


def test_a_packing_is_data():
    """Equal specs on equal meshes give equal packings (the tier exports each once)."""
    assert packing.packing(BUNDLES[:1], MESHES[0]) == packing.packing(BUNDLES[:1], MESHES[0])
    assert packing.packing(BUNDLES[:1], MESHES[0]) != packing.packing(BUNDLES[:1], MESHES[1])
