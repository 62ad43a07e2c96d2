"""How arrays lie on a slice's mesh: the mesh of each slice, the rules that map a parameter's
logical axis names onto it, and the layout (a PartitionSpec) of every buffer.

A slice is a mesh of D devices with four named axes, always in this order (expert last, so
that shapes written before it existed read as they did: mpmd/runtime/worker/mesh.py):

    data    splits each microbatch (data parallelism; gradients are reduced once a step, by
            reduce{k}: mpmd/stages/partials.py)
    fsdp    splits each microbatch too, and the parameter dims the rules put on it (ZeRO-3 style:
            XLA gathers a weight where it is used; its gradient is reduce-scattered by reduce{k})
    tensor  splits the parameter dims the rules put on it (Megatron-style tensor parallelism)
    expert  splits each microbatch too, and a mixture's experts (logical axis "expert"): each
            device holds E / expert of every MoE layer's experts; the tokens routed to them are
            moved there and back inside the stage program (an all-to-all; models/moe.py)

data x fsdp x tensor x expert = D. Slices may differ (`mesh=[{"tensor": 2}, {"data": 2}]`).
Outside the mixture's layers the expert axis is one more data axis (GShard's layout: the
devices that share the experts split the batch of every dense layer).

Who decides a layout (all on the controller, before any worker starts):
- parameters, gradients, optimizer state: the model's logical axis names (Flax metadata
  `out_sharding`, set with `nnx.with_partitioning`) through RULES; an unannotated parameter
  is replicated. Optimizer state follows its parameter (optax.tree_map_params).
- activations, their gradients, inputs, targets: split along axis 0 (the batch) over
  data x fsdp x expert when that divides it, else replicated (`batch_layout`); inside a stage
  program a model may ask for other layouts of its activations by logical axis names
  (mpmd.constrain, mpmd/stages/constraints.py).
- scalars (losses, squared norms): replicated.
- a stage's vjp residuals: left to XLA; they never leave the slice.
Every program is exported against an AbstractMesh of the slice's shape, so the controller
needs no devices; a worker binds the same shape to its own devices.

A layout travels as a PartitionSpec tuple (mpmd.runtime.worker.instructions.Spec.layout; JSON: a list
with one entry per dim, each null, an axis name or a list of axis names).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from mpmd.runtime import compat
from mpmd.stages.specs import spec
from mpmd.runtime.worker import mesh as _mesh
from mpmd.runtime.worker.mesh import AXES, devices_problem, shape_of
from mpmd.stages.mesh_axes import rule_problem

BATCH = ("data", "fsdp", "expert")  # the mesh axes a microbatch is split over

# logical axis name -> mesh axis (or None: replicated). Models in models/ use these names.
RULES: dict[str, str | None] = {
    "vocab": "tensor",  # embedding rows, LM-head columns
    "embed": "fsdp",  # the model width
    "mlp": "tensor",  # MLP hidden width
    "heads": "tensor",  # attention heads x head dim (fused q/k/v or per projection)
    "kv": None,  # key/value width under grouped-query attention
    "positions": None,  # learned position rows
    "layers": None,
    "expert": "expert",  # a mixture's experts (models/moe.py)
}


class LayoutError(ValueError):
    """A mesh or a layout cannot be: a shape whose product is not the slice's devices, a mesh
    axis that does not divide a parameter's dimension, an unknown logical axis or rule."""


class SliceMesh(NamedTuple):
    """The shape of one slice's mesh."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor * self.expert

    @property
    def batch_ways(self) -> int:
        """Into how many parts a microbatch is split on this slice."""
        return math.prod(getattr(self, a) for a in BATCH)

    def abstract(self) -> AbstractMesh:
        return compat.abstract_mesh(tuple(self), AXES)


def describe(mesh: SliceMesh) -> str:
    return _mesh.describe(mesh)


def slice_mesh(shape: Mapping[str, int] | SliceMesh | None, where: str = "mesh") -> SliceMesh:
    """A SliceMesh from {"data": .., "fsdp": .., "tensor": .., "expert": ..} (missing axes are 1)."""
    if shape is None:
        return SliceMesh()
    if isinstance(shape, SliceMesh):
        return shape
    if not isinstance(shape, Mapping):
        raise LayoutError(f"{where} must be a mapping of mesh axes {list(AXES)} to sizes, got {shape!r}")
    try:
        return SliceMesh(*shape_of(shape))
    except ValueError as e:
        raise LayoutError(f"{where}: {e}") from None


def slice_meshes(mesh, num_slices: int, devices_per_slice: int | None = None) -> list[SliceMesh]:
    """One SliceMesh per slice. `mesh`: None (one device per slice, or `devices_per_slice` on
    the data axis), one shape for every slice, or a list with one shape per slice. With
    `devices_per_slice`, every shape's product must equal it; the error names the slice."""
    if mesh is None:
        meshes = [SliceMesh(data=devices_per_slice or 1)] * num_slices
    elif isinstance(mesh, (list, tuple)) and not isinstance(mesh, SliceMesh):
        if len(mesh) != num_slices:
            raise LayoutError(
                f"mesh lists {len(mesh)} slice shape(s) but the schedule has {num_slices} "
                f"slice(s): give one shape per slice, or one shape for all"
            )
        meshes = [slice_mesh(m, f"mesh[{r}] (slice {r})") for r, m in enumerate(mesh)]
    else:
        meshes = [slice_mesh(mesh)] * num_slices
    if devices_per_slice is not None:
        has = f"each slice has {devices_per_slice} (devices_per_worker x processes_per_slice)"
        for r, m in enumerate(meshes):
            if problem := devices_problem(m, devices_per_slice, has):
                raise LayoutError(f"slice {r}: mesh {problem}")
    return meshes


# -- layouts ---------------------------------------------------------------------------------
def batch_layout(shape: Sequence[int], mesh: SliceMesh) -> P:
    """An activation's layout: axis 0 over data x fsdp x expert when that divides it, else replicated."""
    ways = mesh.batch_ways
    if ways > 1 and len(shape) >= 1 and shape[0] % ways == 0:
        return P(tuple(a for a in BATCH if getattr(mesh, a) > 1) or None)
    return P()


def param_layout(axes, shape: Sequence[int], mesh: SliceMesh, rules: Mapping[str, Any], name: str) -> P:
    """The layout of one parameter from its logical axis names (None: replicated). Raises
    ValueError naming the parameter when a mesh axis does not divide its dimension."""
    if axes is None:
        return P()
    if len(axes) != len(shape):
        raise LayoutError(
            f"parameter {name}: {len(axes)} logical axis name(s) {tuple(axes)} for a "
            f"{len(shape)}-d array of shape {tuple(shape)}"
        )
    spec, used = [], set()
    for logical, dim in zip(axes, shape):
        target = rules.get(logical) if logical is not None else None
        if logical is not None and logical not in rules:
            raise LayoutError(
                f"parameter {name}: logical axis {logical!r} has no rule; known: "
                f"{sorted(rules)} (add it to the rules, mapping it to one of {list(AXES)} or None)"
            )
        targets = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        targets = tuple(t for t in targets if getattr(mesh, t) > 1 and t not in used)
        ways = math.prod(getattr(mesh, t) for t in targets)
        if dim % ways:
            raise LayoutError(
                f"parameter {name}: dimension {dim} ({logical!r}) is not divisible by mesh "
                f"axis {'x'.join(targets)}={ways} on a slice of {describe(mesh)}; choose a mesh "
                f"whose {'x'.join(targets)} divides {dim}, or map {logical!r} elsewhere in the rules"
            )
        used.update(targets)
        spec.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    return P(*spec)


def check_rules(rules: Mapping[str, Any]) -> dict:
    """RULES updated by `rules`; ValueError naming an entry that is not a mesh axis or None."""
    merged = dict(RULES)
    for logical, target in (rules or {}).items():
        problem = rule_problem(logical, target, f"rules[{logical!r}]")
        if problem:
            raise LayoutError(problem.replace("or null (replicated)", "or None (replicated)"))
        merged[logical] = target
    return merged


def stage_param_layouts(fn, mesh: SliceMesh, rules: Mapping[str, Any], stage: int) -> tuple[P, ...]:
    """The layouts of a StageFn's parameter leaves on `mesh`, named in errors by their paths."""
    axes = fn.param_axes if fn.param_axes is not None else (None,) * len(fn.param_leaves)
    paths = param_paths(fn)
    return tuple(
        param_layout(a, np.shape(leaf), mesh, rules, f"{paths[i]} of stage {stage}")
        for i, (a, leaf) in enumerate(zip(axes, fn.param_leaves))
    )


def param_paths(fn) -> list[str]:
    """Readable paths of a stage's parameter leaves ("blocks/0/mlp/up/kernel")."""
    try:
        tree = jax.tree.unflatten(fn.param_tree, list(range(len(fn.param_leaves))))
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [
            "/".join(_key(k) for k in path if _key(k) != "value") or f"leaf {i}" for i, (path, _) in enumerate(flat)
        ]
    except Exception:  # a treedef of user records that cannot hold ints
        return [f"leaf {i}" for i in range(len(fn.param_leaves))]


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def optimizer_layouts(optimizer, fn, param_layouts: tuple[P, ...]) -> tuple[P, ...]:
    """Each optimizer-state leaf takes its parameter's layout; the rest (counts) is replicated."""
    import optax

    specs = jax.tree.unflatten(fn.param_tree, [spec(l) for l in fn.param_leaves])
    state = jax.eval_shape(optimizer.init, specs)
    layouts = jax.tree.unflatten(fn.param_tree, list(param_layouts))
    mapped = optax.tree_map_params(
        optimizer,
        lambda _, layout: layout,
        state,
        layouts,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    out = tuple(jax.tree.leaves(mapped, is_leaf=lambda x: isinstance(x, P)))
    assert len(out) == len(jax.tree.leaves(state)), "optimizer state and its layouts differ in length"
    return out


def with_layout(abstract, layout: P, mesh: SliceMesh) -> jax.ShapeDtypeStruct:
    """`abstract` (anything with shape and dtype) as a ShapeDtypeStruct laid out on `mesh`."""
    return jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=NamedSharding(mesh.abstract(), layout))


def batch_pieces(layout: P, mesh: SliceMesh) -> int:
    """Into how many equal parts along axis 0 an array of this layout is split (1: it is not
    split along axis 0, or along other axes too)."""
    entries = tuple(layout)
    if not entries or entries[0] is None or any(e is not None for e in entries[1:]):
        return 1
    first = entries[0] if isinstance(entries[0], tuple) else (entries[0],)
    return math.prod(getattr(mesh, a) for a in first)
