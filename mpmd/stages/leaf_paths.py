"""What every saved leaf is: parameters and optimizer state named by their model path.

A checkpoint addresses a leaf by what it is, not by where it sat, so that it restores onto
any layout (another stage count, schedule, slice count, mesh):
  params/<path>                    a parameter, e.g. params/blocks.3.mlp.up.kernel
  opt/<optax path>/<path>          optimizer state mirroring a parameter, e.g.
                                   opt/0.mu/blocks.3.mlp.up.kernel (adamw's first moment)
  opt/<optax path>                 optimizer state of no parameter, e.g. opt/0.count
  state/<path>                     stage state (mpmd.stages.pipeline.StageState), e.g.
                                   state/blocks.3.drop.rngs.count, state/blocks.3.norm.mean
A weight held by several stages (a tied embedding) has one path, so it is stored once; so is
a non-parameter optimizer leaf (`count`), which every stage's optimizer advances alike (each
stage runs the same optax transformation once per step).

Where paths come from: `mpmd.split` records each stage leaf's path in the model
(`Stages.param_paths`: a layer split from the layers' places in the model, a marked split
from StageFn.param_index); mpmd.Pipeline takes them from there. Stages given as plain
nnx.Modules have no model path: their leaves are named within their stage
(`stage1/layers.0.kernel`), which restores only onto the same stages.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from mpmd.stages import names
from mpmd.stages.specs import spec


class StateNames(NamedTuple):
    params: list[tuple[str, ...]]  # per stage, the name of each of its parameter leaves
    opt: list[tuple[str, ...]]  # per stage, the name of each of its optimizer-state leaves
    scoped: bool  # names carry their stage: they fit only the same stages
    specs: dict  # name -> (shape, dtype name) of every leaf
    state: tuple = ()  # per stage, the name of each of its stage-state leaves

    def buffers(self, k: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(buffer, its leaves' names) of what stage k saves: parameters, optimizer state and,
        when it has any, stage state."""
        out = ((names.params(k), self.params[k]), (names.opt_state(k), self.opt[k]))
        if self.state and self.state[k]:
            out += ((names.stage_state(k), self.state[k]),)
        return out


def path_string(keypath) -> str:
    """'blocks.3.mlp.up.kernel' for a jax key path (an nnx.Variable's trailing `.value` dropped)."""
    parts = [_key(k) for k in keypath]
    if parts and parts[-1] == "value":
        parts = parts[:-1]
    return ".".join(parts)


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def local_paths(fn) -> tuple[str, ...]:
    """Each of a StageFn's parameter leaves' path within its stage, in leaf order."""
    tree = jax.tree.unflatten(fn.param_tree, [spec(l) for l in fn.param_leaves])
    return tuple(path_string(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def stage_param_paths(fns, model_paths) -> tuple[list[tuple[str, ...]], bool]:
    """(per stage its leaves' paths, scoped): the model paths given (mpmd.split's
    `Stages.param_paths`) where they fit the stages (one per leaf), else each stage's own
    paths prefixed by `stage<k>/`."""
    if (
        model_paths is not None
        and len(model_paths) == len(fns)
        and all(len(p) == len(fn.param_leaves) for p, fn in zip(model_paths, fns))
    ):
        return [tuple(p) for p in model_paths], False
    return [tuple(f"stage{k}/{p}" for p in local_paths(fn)) for k, fn in enumerate(fns)], True


def state_names(pipeline, optimizer) -> StateNames:
    """The checkpoint name, shape and dtype of every parameter, optimizer-state and
    stage-state leaf of every stage."""
    params, opt, state, specs = [], [], [], {}
    for k, (fn, paths) in enumerate(zip(pipeline.fns, pipeline.param_paths)):
        params.append(tuple(f"params/{p}" for p in paths))
        opt.append(optimizer_names(optimizer, fn, paths))
        state.append(tuple(f"state/{p}" for p in state_paths(fn, paths, k, pipeline.scoped_paths)))
        tree = jax.tree.unflatten(fn.param_tree, [spec(l) for l in fn.param_leaves])
        kept = fn.state.leaves if fn.state is not None else ()
        for name, leaf in zip(
            params[-1] + opt[-1] + state[-1],
            [spec(l) for l in fn.param_leaves]
            + jax.tree.leaves(jax.eval_shape(optimizer.init, tree))
            + [spec(l) for l in kept],
        ):
            specs[name] = (tuple(leaf.shape), np.dtype(leaf.dtype).name)
    return StateNames(params, opt, pipeline.scoped_paths, specs, tuple(state))


def state_paths(fn, paths: tuple[str, ...], k: int, scoped: bool) -> tuple[str, ...]:
    """Each of a stage's state leaves' path in the model: its path within the stage with the
    stage's own prefix of that layer (`layers.0`) replaced by the layer's place in the model
    (`blocks.3`), as its parameters' paths say; `stage<k>/...` where they cannot say."""
    if fn.state is None:
        return ()
    if fn.param_index is not None and not scoped:
        return fn.state.paths  # cut from one model at its marks: already paths in the model
    prefixes = {}  # a layer's prefix within the stage -> its prefix in the model
    if not scoped:
        for local, model in zip(local_paths(fn), paths):
            a, b = local.split("."), model.split(".")
            n = 0
            while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
                n += 1
            prefixes[".".join(a[: len(a) - n])] = ".".join(b[: len(b) - n])
    out = []
    for path in fn.state.paths:
        best = max((p for p in prefixes if p and path.startswith(p + ".")), key=len, default=None)
        out.append(prefixes[best] + path[len(best) :] if best is not None and prefixes[best] else f"stage{k}/{path}")
    return tuple(out)


def optimizer_names(optimizer, fn, paths: tuple[str, ...]) -> tuple[str, ...]:
    """opt/<optax path>[/<parameter path>] of each leaf of the stage's optimizer state, in
    the order the stage's opt_init program returns them (jax.tree.leaves of optax's state)."""
    import optax

    tree = jax.tree.unflatten(fn.param_tree, [spec(l) for l in fn.param_leaves])
    state = jax.eval_shape(optimizer.init, tree)
    local = [kp for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    index = jax.tree.unflatten(fn.param_tree, list(range(len(local))))
    # Which parameter each state leaf mirrors (-1: none), as optax itself maps them.
    mirrors = optax.tree_map_params(optimizer, lambda _, i: i, state, index, transform_non_params=lambda _: -1)
    out = []
    for (keypath, _), i in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(mirrors)):
        if i < 0:
            out.append(f"opt/{path_string(keypath)}")
            continue
        prefix = keypath[: len(keypath) - len(local[i])]
        assert tuple(keypath[len(prefix) :]) == tuple(local[i]), (keypath, local[i])
        out.append(f"opt/{path_string(prefix)}/{paths[i]}")
    assert len(set(out)) == len(out), f"optimizer state names collide: {out}"
    return tuple(out)
