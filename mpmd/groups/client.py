"""Programs on groups of slices, and handles to the arrays they leave there: the Pathways
client's model on mpmd's runtime.

    groups = Groups(cluster, {"learner": [{"data": 2}], "sampler": [{"tensor": 2}]})
    w = groups.put({"w": np.ones((4, 4), np.float32)}, "learner", P("data"))
    y = groups.run(lambda t: t["w"] * 2, w)            # runs on the learner's slice; y stays there
    z = groups.move(y, "sampler", P(None, "tensor"))   # slice to slice, resharded on arrival
    groups.fetch(z)                                     # numpy, on the controller

A *group* is a named run of the cluster's slices, each with its own mesh (data, fsdp, tensor,
expert: mpmd/stages/sharding.py). A *handle* is a pytree of arrays that lives on one slice:
the controller knows its structure, shapes, dtypes and layouts, never its bytes, until it
is fetched. A program (a function of pytrees of arrays, as `jax.jit` takes it) runs on the
slice its arguments live on; it is exported once per argument signature (jax.export, against
an AbstractMesh of the slice's shape: the controller needs no devices) and loaded there. A
move is one Send on the sending slice and one Recv on the receiving one: the pieces go over
the data plane, slice to slice, and the receiver assembles them in the target layout
(mpmd/runtime/wire/reshard.py); the controller routes them and never holds the bytes.

Every call is one run of the runtime (Cluster.launch): a short instruction stream for each
slice (empty for a slice the call does not touch), sent without waiting. Each slice runs its
runs in order, and a Recv waits for its Send, so data dependencies hold without the
controller waiting for anything: it runs ahead by up to WINDOW calls, and collects a call's
result (raising its error) when the window is full, at `fetch` and at `wait`. A handle
deleted here is freed on its slice by the next call's stream, after every call before it.

Layouts are PartitionSpecs over the slice's mesh axes. A put, move or program output without
one is replicated over the slice's devices.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mpmd.groups.cluster import GroupCluster
from mpmd.runtime.control.cluster import Discarded, WorkerLost
from mpmd.runtime.worker import programs
from mpmd.runtime.worker.instructions import Delete, Recv, Run, Send, Spec
from mpmd.stages import sharding

WINDOW = 8  # calls dispatched ahead of the oldest one still uncollected


class Group(NamedTuple):
    """Named slices of the cluster and their meshes."""

    name: str
    slices: tuple[int, ...]
    meshes: tuple[sharding.SliceMesh, ...]


class Handle(NamedTuple):
    """A pytree of arrays on one slice: what is known of it on the controller."""

    slice: int
    name: str  # the buffer on the slice
    treedef: Any
    specs: tuple[Spec, ...]  # per leaf: shape, dtype, layout on the slice's mesh

    @property
    def shapes(self):
        """The pytree of jax.ShapeDtypeStruct (without shardings) the handle holds."""
        return jax.tree.unflatten(self.treedef, [jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype)) for s in self.specs])


class Groups:
    """A cluster's slices in named groups, and the handles left on them (module docstring).

    `groups`: name -> one mesh shape per slice of the group ({"data": .., "tensor": ..} or a
    SliceMesh; a single shape is a group of one slice). The groups take slices 0, 1, ... in
    the order given; the cluster is started with all of them. `root`: as Cluster.start."""

    def __init__(self, cluster, groups: Mapping[str, Any], root: str | None = None):
        if not groups:
            raise ValueError("groups: name at least one group of slices, e.g. {'sampler': {'tensor': 2}}")
        self.groups: dict[str, Group] = {}
        meshes: list[sharding.SliceMesh] = []
        for name, shapes in groups.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"a group's name must be a non-empty string, got {name!r}")
            shapes = (
                list(shapes)
                if isinstance(shapes, (list, tuple)) and not isinstance(shapes, sharding.SliceMesh)
                else [shapes]
            )
            if not shapes:
                raise ValueError(f"group {name!r} has no slices: give one mesh shape per slice")
            mine = [sharding.slice_mesh(s, f"group {name!r} slice {k} mesh") for k, s in enumerate(shapes)]
            self.groups[name] = Group(name, tuple(range(len(meshes), len(meshes) + len(mine))), tuple(mine))
            meshes.extend(mine)
        self.meshes = meshes
        self.cluster = cluster
        fixed = cluster.devices_per_slice
        for r, m in enumerate(meshes):
            if fixed is not None and m.size != fixed:
                raise ValueError(
                    f"slice {r} ({self._group_of(r).name}) has a mesh of {m.size} device(s) but the "
                    f"cluster's slices have {fixed} each (devices_per_worker x processes_per_slice)"
                )
        self.root = os.path.abspath(root) if root is not None else None
        cluster.start(len(meshes), root=root, meshes=[dict(m._asdict()) for m in meshes])
        self._names = itertools.count()
        self._runs = itertools.count()
        self._plans = 0
        self._failed: BaseException | None = None  # an error of a call of ours, collected for another
        # Losses: a run that fails with WorkerLost marks its slice dead until replaced; the runs
        # behind it are Discarded (last_failure says why); a replacement starts a new generation
        # of the slice, and every handle on it from before is gone.
        self._dead: set[int] = set()
        self.last_failure: BaseException | None = None
        self.generations = [0] * len(meshes)
        self._pending: deque = deque()
        self._programs: dict[tuple, str] = {}  # (slice, signature) -> loaded program name
        self._exported: dict[tuple, tuple] = {}  # (mesh, signature) -> (ProgramSpec, out treedef, out specs)
        self._deletes: dict[int, list[str]] = {}

    # -- placing -----------------------------------------------------------------------------
    def _group(self, where) -> Group:
        group = self.groups.get(where) if isinstance(where, str) else where
        if not isinstance(group, Group) or self.groups.get(group.name) != group:
            raise ValueError(f"no group {where!r}; the groups are {sorted(self.groups)}")
        return group

    def slice_of(self, where, k: int | None = None) -> int:
        """The slice `where` names: a group (or its name) of one slice, or slice k of it."""
        group = self._group(where)
        if k is None:
            if len(group.slices) != 1:
                raise ValueError(
                    f"group {group.name!r} has {len(group.slices)} slices: say which (k in 0..{len(group.slices) - 1})"
                )
            k = 0
        if not 0 <= k < len(group.slices):
            raise ValueError(f"group {group.name!r} has no slice {k}; it has {len(group.slices)}")
        return group.slices[k]

    def _group_of(self, r: int) -> Group:
        return next(g for g in self.groups.values() if r in g.slices)

    def _specs(self, r: int, shapes: Sequence, layouts, what: str) -> tuple[Spec, ...]:
        """Per leaf, its Spec on slice r: `layouts` a prefix pytree of PartitionSpecs (None: replicated)."""
        out = []
        for s, layout in zip(shapes, layouts):
            layout = P() if layout is None else layout
            if not isinstance(layout, P):
                raise ValueError(f"{what}: a layout must be a PartitionSpec, got {layout!r}")
            if problem := _divides(s.shape, layout, self.meshes[r]):
                raise ValueError(f"{what}: {problem}")
            out.append(Spec(tuple(s.shape), np.dtype(s.dtype).name, tuple(layout)))
        return tuple(out)

    def put(self, tree, where, layouts=None, k: int | None = None) -> Handle:
        """`tree` (arrays, on this host) placed on a slice of `where`, laid out as `layouts`."""
        r = self.slice_of(where, k)
        leaves, treedef = jax.tree.flatten(tree)
        arrays = [np.asarray(a) for a in leaves]
        specs = self._specs(r, arrays, _leaf_layouts(layouts, tree, treedef), f"put on {where!r}")
        name = f"h{next(self._names)}"
        self._verb(lambda: self.cluster.put(r, name, arrays, layouts=[s.layout for s in specs]))
        return Handle(r, name, treedef, specs)

    # -- calls -------------------------------------------------------------------------------
    def run(self, fn: Callable, *args: Handle, out_layouts=None) -> Handle:
        """`fn(*pytrees)` on the slice its arguments live on; its result stays there.
        `out_layouts`: a prefix pytree of PartitionSpecs of the result (None: replicated)."""
        if not args or not all(isinstance(a, Handle) for a in args):
            raise ValueError("run takes handles (Groups.put, run or move); put host arrays first")
        r = args[0].slice
        if any(a.slice != r for a in args):
            raise ValueError(
                f"run's arguments live on slices {sorted({a.slice for a in args})}: move them to one slice first"
            )
        signature = (fn, tuple((a.treedef, a.specs) for a in args), _frozen(out_layouts))
        program, treedef, specs = self._program(r, signature)
        out = Handle(r, f"h{next(self._names)}", treedef, specs)
        self._launch({r: [Run(program, tuple(a.name for a in args), (out.name,), label=getattr(fn, "__name__", "fn"))]})
        return out

    def move(self, handle: Handle, where, layouts=None, k: int | None = None) -> Handle:
        """The handle's arrays on a slice of `where`, laid out as `layouts`."""
        return self.move_all([handle], where, [layouts], k)[0]

    def move_all(self, handles: Sequence[Handle], where, layouts: Sequence | None = None, k: int | None = None):
        """Every handle's arrays on a slice of `where` (handle i laid out as layouts[i]), in one
        call: the transfers of all of them are in flight at once."""
        dst = self.slice_of(where, k)
        layouts = [None] * len(handles) if layouts is None else list(layouts)
        if len(layouts) != len(handles):
            raise ValueError(f"move_all: {len(handles)} handle(s) but {len(layouts)} layouts")
        streams: dict[int, list] = {}
        out = []
        for handle, laid in zip(handles, layouts):
            if handle.slice == dst:  # on its own slice: a program lays it out anew
                out.append(self.run(_identity, handle, out_layouts=laid))
                continue
            shapes = handle.shapes
            specs = self._specs(
                dst, jax.tree.leaves(shapes), _leaf_layouts(laid, shapes, handle.treedef), f"move to {where!r}"
            )
            src = handle.slice
            pieces = tuple(sharding.batch_pieces(P(*s.layout), self.meshes[src]) for s in handle.specs)
            moved = Handle(dst, f"h{next(self._names)}", handle.treedef, specs)
            key = f"move/{moved.name}"
            streams.setdefault(src, []).append(Send(handle.name, dst, key, pieces))
            streams.setdefault(dst, []).append(Recv(moved.name, src, key, specs, pieces))
            out.append(moved)
        if streams:
            self._launch(streams)
        return out

    def delete(self, *handles: Handle) -> None:
        """Free the handles' arrays on their slices, after every call made before this one."""
        for h in handles:
            self._deletes.setdefault(h.slice, []).append(h.name)

    def fetch(self, handle: Handle):
        """The handle's arrays, as numpy, here (waits for every call made before)."""
        self.wait()
        arrays = self._verb(lambda: self.cluster.get(handle.slice, [handle.name]))[handle.name]
        return jax.tree.unflatten(handle.treedef, list(arrays))

    def wait(self) -> None:
        """Collect every call in flight (a Trainer's on a group's cluster too), raising the
        first error of one made here."""
        while self._pending:
            self._collect_oldest()
        self._raise_failed()

    def close(self, close_cluster: bool = True) -> None:
        """Collect what is in flight; then close the cluster (and every worker it started),
        unless close_cluster=False (its workers stay up for the next user, as Trainer.close)."""
        try:
            self.wait()
        finally:
            self._pending.clear()
            if close_cluster:
                self.cluster.close()

    # -- losses -----------------------------------------------------------------------------
    def replace(self, r: int, force: bool = False) -> bool:
        """A new worker for slice r if a call found it lost (or `force`): Cluster.replace, the
        same programs and plans, none of its arrays (its handles are gone: `generations[r]`
        moves on). Whether it replaced one."""
        if r not in self._dead and not force:
            return False
        self.cluster.replace(r)
        self._dead.discard(r)
        self.generations[r] += 1
        return True

    def _verb(self, call):
        """`call()`, a verb to one slice; a slice it finds lost is marked so (`replace`)."""
        try:
            return call()
        except WorkerLost as e:
            if e.slice_index is not None:
                self._dead.add(e.slice_index)
            self.last_failure = e
            raise

    def loss_of(self, error: BaseException) -> WorkerLost | None:
        """The WorkerLost a call's error stands for: itself, or for a Discarded call the loss
        that discarded it (None: not a loss)."""
        if isinstance(error, WorkerLost):
            return error
        if isinstance(error, Discarded) and isinstance(self.last_failure, WorkerLost):
            return self.last_failure
        return None

    def cluster_for(self, group) -> GroupCluster:
        """A Cluster of the group's slices alone, for a Trainer (its slices are this group): see
        mpmd/groups/cluster.py."""
        return GroupCluster(self, self.groups[self._group(group).name])

    def launch(self, plan: str, feeds=None, fetch=None, trace: bool = False, own: bool = False) -> "Call":
        """Run plan `plan` on every slice with the next run id: a Call, collected in the order
        calls were made (whoever made them: a Trainer on a group's cluster shares this order).
        `own`: a call of this client's, whose error the next call, fetch or wait raises."""
        pending = self.cluster.launch(plan, next(self._runs), feeds or {}, fetch or {}, trace)
        call = Call(self, pending, own, tuple(self.generations))
        self._pending.append(call)
        return call

    def _collect_oldest(self) -> None:
        """Collect the oldest call in flight, keeping its result (or error) for its maker."""
        call = self._pending.popleft()
        try:
            call._value = call._pending.result()
        except BaseException as e:
            call._error = e
            if not isinstance(e, Discarded):
                self.last_failure = e
            r = e.slice_index if isinstance(e, WorkerLost) else None
            # A loss reported by a call made before the slice's replacement is that old loss.
            if r is not None and call.generations[r] == self.generations[r]:
                self._dead.add(r)
            if call.own and self._failed is None:
                self._failed = e
        call._done = True

    def _raise_failed(self) -> None:
        if self._failed is not None:
            e, self._failed = self._failed, None
            raise e

    # -- the runtime ---------------------------------------------------------------------------
    def _program(self, r: int, signature) -> tuple[str, Any, tuple[Spec, ...]]:
        """The program for this signature, loaded on slice r: (name, out treedef, out specs)."""
        mesh = self.meshes[r]
        if (mesh, signature) not in self._exported:
            fn, args, out_layouts = signature
            abstract = [
                jax.tree.unflatten(
                    td,
                    [
                        sharding.with_layout(jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype)), P(*s.layout), mesh)
                        for s in ss
                    ],
                )
                for td, ss in args
            ]
            out_shapes = jax.eval_shape(fn, *abstract)
            out_leaves, out_treedef = jax.tree.flatten(out_shapes)
            specs = self._specs(
                r, out_leaves, _leaf_layouts(_thawed(out_layouts), out_shapes, out_treedef), "run's out_layouts"
            )
            treedefs = [td for td, _ in args]

            def bundles(*bundles):
                trees = [jax.tree.unflatten(td, list(b)) for td, b in zip(treedefs, bundles)]
                return (tuple(jax.tree.leaves(fn(*trees))),)

            shard = [NamedSharding(mesh.abstract(), P(*s.layout)) for s in specs]
            spec = programs.exported(
                bundles, *[tuple(jax.tree.leaves(a)) for a in abstract], out_shardings=(tuple(shard),)
            )
            self._exported[(mesh, signature)] = (spec, out_treedef, specs)
        spec, out_treedef, specs = self._exported[(mesh, signature)]
        if (r, signature) not in self._programs:
            name = f"groups/p{len(self._programs)}"
            self._verb(lambda: self.cluster.load_programs(r, {name: spec}))
            self._programs[(r, signature)] = name
        return self._programs[(r, signature)], out_treedef, specs

    def _launch(self, streams: dict[int, list]) -> None:
        """One run: `streams[slice]` on the slices named (after the deletes owed there), an
        empty stream on the others."""
        while len(self._pending) >= WINDOW:
            self._collect_oldest()
        self._raise_failed()
        plan = f"groups/{self._plans % (WINDOW + 1)}"  # distinct from every call still in flight
        self._plans += 1
        for r in range(len(self.meshes)):
            owed = [Delete(n) for n in self._deletes.pop(r, ())]
            self._verb(lambda: self.cluster.install_plan(r, plan, owed + streams.get(r, [])))
        self.launch(plan, own=True)


class Resident:
    """Arrays a client keeps on a slice of a group: put on first use, and again on each new
    worker of the slice (a replacement holds none of them: `Groups.generations`)."""

    def __init__(self, groups: Groups, tree, where, layouts=None):
        self._groups, self._tree, self._where, self._layouts = groups, tree, where, layouts
        self._slice, self._generation, self._handle = groups.slice_of(where), None, None

    @property
    def handle(self) -> Handle:
        if self._generation != self._groups.generations[self._slice]:
            self._handle = self._groups.put(self._tree, self._where, self._layouts)
            self._generation = self._groups.generations[self._slice]
        return self._handle


class Call:
    """A run launched through Groups: `result()` collects every call before it first (the
    runtime collects runs oldest first), keeping their results for whoever made them."""

    def __init__(self, groups: Groups, pending, own: bool, generations: tuple):
        self._groups, self._pending, self.own = groups, pending, own
        self.generations = generations  # each slice's generation when it was made
        self._done = False
        self._value = self._error = None

    @property
    def run(self) -> int:
        return self._pending.run

    def result(self):
        while not self._done:
            self._groups._collect_oldest()
        if self._error is not None:
            raise self._error
        return self._value


def _identity(tree):
    return tree


def _leaf_layouts(layouts, tree, treedef) -> list:
    """Per leaf of `tree`, its PartitionSpec from `layouts`: one for all, a prefix of the tree,
    or a flat sequence with one per leaf (in jax.tree.leaves order); None: replicated."""
    spec_like = lambda x: isinstance(x, P) or x is None
    if layouts is None or isinstance(layouts, P):
        return [layouts] * treedef.num_leaves
    try:
        full = jax.tree.broadcast(layouts, tree, is_leaf=spec_like)
    except (ValueError, TypeError) as e:
        flat = isinstance(layouts, (list, tuple)) and all(spec_like(x) for x in layouts)
        if flat and len(layouts) == treedef.num_leaves:
            return list(layouts)
        raise ValueError(
            f"layouts must be a PartitionSpec, a prefix of the arrays' pytree or one per leaf "
            f"({treedef.num_leaves}): {e}"
        ) from None
    return jax.tree.leaves(full, is_leaf=spec_like)


def _divides(shape, layout: P, mesh: sharding.SliceMesh) -> str | None:
    if len(layout) > len(shape):
        return f"layout {layout} has {len(layout)} entries for an array of shape {tuple(shape)}"
    sizes = dict(mesh._asdict())
    for d, entry in enumerate(layout):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        if unknown := [a for a in axes if a not in sizes]:
            return f"layout {layout} names mesh axes {unknown}; a slice's axes are {list(sizes)}"
        ways = int(np.prod([sizes[a] for a in axes])) if axes else 1
        if shape[d] % ways:
            return f"layout {layout} splits dim {d} of shape {tuple(shape)} {ways} ways, which does not divide it"
    return None


def _frozen(layouts):
    """A hashable form of a layouts pytree (signatures key the program cache)."""
    if layouts is None or isinstance(layouts, P):
        return layouts
    leaves, treedef = jax.tree.flatten(layouts, is_leaf=lambda x: isinstance(x, P) or x is None)
    return ("tree", treedef, tuple(leaves))


def _thawed(frozen):
    if isinstance(frozen, tuple) and frozen and frozen[0] == "tree":
        return jax.tree.unflatten(frozen[1], list(frozen[2]))
    return frozen
