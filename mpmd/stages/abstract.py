"""Abstract models: build nothing on the controller, materialise each stage on its slice.

    model = mpmd.abstract(lambda: GPT(..., rngs=nnx.Rngs(0)))    # shapes only, no arrays
    stages = mpmd.split(model, num_stages=4)                     # works on the abstract model

The Trainer then ships each slice an init program: the user's own factory traced with
`jax.export`, of which XLA keeps only the part that initialises that slice's stage. The
seeded initialisers run on the slice, so a model larger than the controller's memory never
exists there. Values equal an eager `factory()` up to float32 rounding (XLA may fuse the
initialiser's arithmetic differently from op-by-op execution).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
from flax import nnx

from mpmd.runtime.worker import programs
from mpmd.stages.pipeline import carried_values
from mpmd.stages.split import Layers


class _Origin(NamedTuple):
    factory: Callable
    root: nnx.Module  # keeps the abstract model (and so the ids below) alive
    path: tuple


_ORIGINS: dict[int, _Origin] = {}


def abstract(factory: Callable[[], nnx.Module]) -> nnx.Module:
    """`nnx.eval_shape(factory)`, remembering how to build each submodule for real."""
    if not callable(factory):
        raise ValueError(f"mpmd.abstract needs a zero-argument function that builds the model, got {factory!r}")
    root = nnx.eval_shape(factory)
    if not isinstance(root, nnx.Module):
        raise ValueError(f"mpmd.abstract: the factory must return an nnx.Module, got {type(root).__name__}")
    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Module):
            _ORIGINS[id(node)] = _Origin(factory, root, tuple(path))
    return root


def is_abstract(leaves) -> bool:
    return any(isinstance(l, jax.ShapeDtypeStruct) for l in leaves)


def init_program(stage: nnx.Module, param_tree, shardings, state_shardings=None) -> programs.ProgramSpec:
    """A program with no inputs whose output bundle is the stage's parameter leaves, each made
    directly in its sharding (`shardings`, one per leaf), and with `state_shardings` a second
    bundle: its stage state (mpmd.stages.pipeline.StageState), one sharding per leaf.
    `shardings` None: the stage state alone (its parameters come from elsewhere: XLA keeps
    only the initialisers the state needs)."""
    parts = _parts(stage)
    factory = _ORIGINS[id(parts[0])].factory if parts else None
    if parts is None or any(_ORIGINS[id(p)].factory is not factory for p in parts):
        raise ValueError(
            f"stage {type(stage).__name__} has abstract parameters but was not built by "
            f"mpmd.abstract(factory) (alone or as an mpmd.split of one); cannot initialise it"
        )
    paths = [_ORIGINS[id(p)].path for p in parts]
    sequential = parts != [stage]

    def init():
        model = factory()
        nodes = {tuple(p): n for p, n in nnx.iter_graph(model)}
        built = Layers(*[nodes[p] for p in paths]) if sequential else nodes[paths[0]]
        _, params, rest = nnx.split(built, nnx.Param, ...)
        assert jax.tree.structure(params) == param_tree, "abstract and concrete stage differ in structure"
        made = (tuple(jax.tree.leaves(params)),) if shardings is not None else ()
        return made + ((carried_values(jax.tree.leaves(rest)),) if state_shardings is not None else ())

    out = ((tuple(shardings),) if shardings is not None else ()) + (
        (tuple(state_shardings),) if state_shardings is not None else ()
    )
    return programs.exported(init, out_shardings=out)


def _parts(stage: nnx.Module):
    """The registered modules a stage consists of: itself, or the layers of a split's Layers
    (or of an nnx.Sequential of them, whose parameters sit at the same paths)."""
    if id(stage) in _ORIGINS:
        return [stage]
    layers = getattr(stage, "layers", None) if isinstance(stage, (Layers, nnx.Sequential)) else None
    if layers and all(id(l) in _ORIGINS for l in layers):
        return list(layers)
    return None
