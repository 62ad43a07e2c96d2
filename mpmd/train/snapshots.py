"""The in-memory checkpoint tier: every k steps each slice snapshots its state in host
memory and sends a copy to a peer slice; a lost slice is restored from its peer's copy.

Like Orbax's multi-tier ("emergency") checkpointing, which MaxText uses on Pathways: cheap
in-memory snapshots every few steps, replicated across slices, persistent saves rarely
(mpmd/train/checkpoints.py). A snapshot is one plan run on every slice:

    slice r:  Run pack{k}: p{k}, o{k}[, st{k}] -> pk{k}   for its stages k: one array per dtype
              Copy pk{k} -> s{g}/pk{k} (host)
              Send pk{k} to slice peer(r)            the peer keeps it as c{g}/pk{k}
              Recv c{g}/pk{k'} from each slice whose peer r is, Copy to host

Packed (mpmd/train/packing.py), a stage's ~40 arrays are one per dtype: one compiled
program concatenates them on the slice's devices (no data moves between devices), one
host copy, one transfer entry and one re-placement per dtype, where each array on its own
cost a dispatch and ~150 us of reshard.assemble on the receiver. Restoring unpacks with the
inverse program.

`peer(r) = (r + 1) % P`: a ring, so each slice holds one other slice's state and the loss
of any one slice loses no snapshot. On CPU the own snapshot costs one concatenation (the
host copy is the packed array itself: arrays are immutable and never donated); the peer
copy costs one transfer of the slice's state over the data plane, authenticated like
activations (the keys are hashed with the session's secret).

Two generations (g = 0, 1) alternate: a snapshot overwrites the older one, so while it runs
(or if it fails half done, a slice lost mid-way) the newer one is intact on every slice. A
generation is usable once its plan returned on every slice. Host memory per slice is then
2 x (own state + the peer's state) at most, packed (a replicated leaf's chunks padded to
a multiple of its replicas: a few elements).

Recovery. A replaced slice has lost both its snapshots and the copies it held. Generation g
restores iff no replaced slice's peer was replaced too: survivors bind their own snapshot,
each replaced slice receives its state from its peer. Otherwise (a slice and its peer lost
at once, or one slice only) recovery falls back to the persistent tier. After a restore a
fresh snapshot is taken at once, so the replacement holds its peer's copy again.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, NamedTuple

import jax

from mpmd.stages import names, sharding
from mpmd.runtime.wire import format as wire
from mpmd.runtime.worker.instructions import Copy, Delete, Recv, Run, Send, Spec
from mpmd.train import packing

log = logging.getLogger("mpmd")

RESTORE_PLAN = "restore_memory"


def snapshot_plan(g: int) -> str:
    return f"snapshot{g}"


class Generation(NamedTuple):
    step: int
    data_state: object
    missing: frozenset = frozenset()  # slices replaced since: their own copies are gone


class Launched(NamedTuple):
    generation: int
    step: int
    data_state: object
    run: object  # the cluster's PendingRun


class MemorySnapshots:
    """The controller's side of the in-memory tier.

    `state_specs`: per stage, {buffer: (Spec per array)} of its parameters, optimizer state
    and stage state; `placement`: stage -> slice; `launch(plan)`: sends a plan to every slice with a
    fresh run id (the Trainer's) and returns the cluster's PendingRun, whose result raises
    WorkerLost if a slice is gone; `meshes`: per slice, its sharding.SliceMesh (default: one
    device each).
    """

    def __init__(
        self,
        cluster,
        placement: tuple[int, ...],
        state_specs: list[dict[str, tuple[Spec, ...]]],
        every: int,
        launch: Callable[[str], object],
        meshes=None,
    ):
        assert every >= 1, "steps between snapshots: checked by options.Checkpointing"
        self.cluster = cluster
        self.placement = placement
        self.num_slices = max(placement) + 1
        self.meshes = list(meshes) if meshes is not None else [sharding.SliceMesh()] * self.num_slices
        self._buffers = [tuple(stage) for stage in state_specs]  # per stage, what it snapshots
        # Per stage, how its buffers pack on its slice's mesh; the programs are the same for
        # every stage whose state has the same specs (exported once, see _programs).
        self.packings = [
            packing.packing(tuple(stage.values()), self.meshes[placement[k]]) for k, stage in enumerate(state_specs)
        ]
        self.every = every
        self._launch = launch
        self.generations: list[Generation | None] = [None, None]
        self.last_snapshot_s = 0.0  # the last snapshot plan's time on its slowest slice
        for r in range(self.num_slices):
            cluster.load_programs(
                r,
                {
                    names.program(kind, k): spec
                    for k in self._stages(r)
                    for kind, spec in zip(("pack", "unpack"), _programs(self.packings[k]))
                },
            )
            for g in (0, 1):
                cluster.install_plan(r, snapshot_plan(g), self._snapshot_stream(r, g))
        log.info(
            "in-memory checkpoints every %d step(s); host memory per slice at most: %s",
            every,
            ", ".join(f"slice {r} {self.host_bytes(r) / 2**20:.1f} MiB" for r in range(self.num_slices)),
        )

    def peer(self, r: int) -> int | None:
        """The slice that holds slice r's copy (None with one slice: no copy)."""
        return (r + 1) % self.num_slices if self.num_slices > 1 else None

    def _stages(self, r: int) -> list[int]:
        return [k for k, s in enumerate(self.placement) if s == r]

    def _held(self, r: int) -> list[tuple[int, int]]:
        """(source slice, stage) of the copies slice r holds."""
        return [(src, k) for src in range(self.num_slices) if self.peer(src) == r for k in self._stages(src)]

    def _copy_specs(self, k: int, r: int) -> tuple[Spec, ...]:
        """Stage k's packed state as slice r holds it: split over r's mesh as on its own slice
        where r's devices divide its rows, else whole on each (meshes of other sizes)."""
        specs = self.packings[k].packed_specs
        if self.packings[k].mesh.size % self.meshes[r].size:
            return tuple(s._replace(layout=()) for s in specs)
        return specs

    def host_bytes(self, r: int) -> int:
        """Host memory slice r spends on this tier at most: two generations of its own state
        and of the copy it holds, packed (see the module docstring for CPU)."""
        size = lambda k: wire.nbytes(self.packings[k].packed_specs)
        return 2 * (sum(size(k) for k in self._stages(r)) + sum(size(k) for _, k in self._held(r)))

    def _snapshot_stream(self, r: int, g: int) -> list:
        stream = []
        for k in self._stages(r):
            stream += [
                Run(names.program("pack", k), self._buffers[k], (names.packed(k),), f"pack s{k}"),
                Copy(names.packed(k), names.snapshot(g, k), "host"),
            ]
            if self.peer(r) is not None:
                stream.append(Send(names.packed(k), self.peer(r), names.snapshot_key(g, k), self.packings[k].pieces))
            stream.append(Delete(names.packed(k)))
        for src, k in self._held(r):
            copy = names.peer_copy(g, k)
            stream += [
                Recv(copy, src, names.snapshot_key(g, k), self._copy_specs(k, r), self.packings[k].pieces),
                Copy(copy, copy, "host"),
            ]
        return stream

    # -- the step loop ---------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.every == 0

    def newest(self) -> Generation | None:
        done = [gen for gen in self.generations if gen is not None]
        return max(done, key=lambda gen: gen.step) if done else None

    def launch(self, step: int, data_state) -> "Launched":
        """Send the snapshot of every slice's state after `step` (to run right behind that
        step) into the generation that is not the newest complete one; `finish` collects it.
        The caller keeps at most one snapshot in flight."""
        newest = self.newest()
        g = 0 if newest is None else 1 - self._index(newest)
        self.generations[g] = None  # being overwritten: not usable meanwhile
        return Launched(g, step, data_state, self._launch(snapshot_plan(g)))

    def finish(self, launched: "Launched") -> None:
        """Wait for a launched snapshot; its generation is usable from now on. WorkerLost (from
        the run) leaves the other generation as it was."""
        results = launched.run.result()
        self.last_snapshot_s = max(r.wall_s for r in results)
        self.generations[launched.generation] = Generation(launched.step, launched.data_state)

    def snapshot(self, step: int, data_state) -> None:
        """Snapshot now (nothing else in flight), waiting for it."""
        self.finish(self.launch(step, data_state))

    def _index(self, gen: Generation) -> int:
        return next(g for g, held in enumerate(self.generations) if held is gen)

    def forget(self) -> None:
        """Drop both generations (the slices were restored from elsewhere)."""
        self.generations = [None, None]

    # -- recovery ----------------------------------------------------------------------
    def replaced(self, r: int) -> None:
        """Slice r was replaced: its snapshots and the copies it held are gone."""
        self.generations = [
            None if gen is None else gen._replace(missing=gen.missing | {r}) for gen in self.generations
        ]

    def restorable(self) -> Generation | None:
        """The newest generation every slice's state can be rebuilt from, or None."""
        ok = [
            gen
            for gen in self.generations
            if gen is not None
            and all(self.peer(r) is not None and self.peer(r) not in gen.missing for r in gen.missing)
        ]
        return max(ok, key=lambda gen: gen.step) if ok else None

    def restore(self) -> Generation:
        """Put every slice back at the newest restorable generation (survivors from their own
        snapshot, replaced slices from their peer's copy), then snapshot again so the
        replacements hold copies once more. WorkerLost if another slice is lost meanwhile."""
        gen = self.restorable()
        assert gen is not None, "restore() without a restorable generation"
        g = self._index(gen)
        for r in range(self.num_slices):
            stream = [
                Send(names.peer_copy(g, k), src, names.restore_key(k), self.packings[k].pieces)
                for src, k in self._held(r)
                if src in gen.missing
            ]
            for k in self._stages(r):
                if r in gen.missing:
                    stream.append(
                        Recv(
                            names.packed(k),
                            self.peer(r),
                            names.restore_key(k),
                            self.packings[k].packed_specs,
                            self.packings[k].pieces,
                        )
                    )
                else:
                    stream.append(Copy(names.snapshot(g, k), names.packed(k), "device"))
                stream += [
                    Run(names.program("unpack", k), (names.packed(k),), self._buffers[k], f"unpack s{k}"),
                    Delete(names.packed(k)),
                ]
            self.cluster.install_plan(r, RESTORE_PLAN, stream)
        self._launch(RESTORE_PLAN).result()
        self.snapshot(gen.step, gen.data_state)
        return gen


@functools.lru_cache(maxsize=64)
def _programs(layout: packing.Packing):
    """(pack, unpack) ProgramSpecs for a packing: exported once per distinct state layout."""
    return packing.exported(layout)


def state_specs(pipeline, optimizer, layout) -> list[dict[str, tuple[Spec, ...]]]:
    """Per stage, {p{k}: specs, o{k}: specs[, st{k}: specs]} of its parameters, optimizer
    state and stage state as laid out on its slice (mpmd.lowering.core.Layout; stage state
    replicated)."""
    out = []
    for k, fn in enumerate(pipeline.fns):
        params = [jax.ShapeDtypeStruct(tuple(l.shape), l.dtype) for l in fn.param_leaves]
        opt = jax.eval_shape(lambda p: jax.tree.leaves(optimizer.init(jax.tree.unflatten(fn.param_tree, p))), params)
        spec = lambda leaves, layouts: tuple(
            Spec(tuple(l.shape), str(jax.numpy.dtype(l.dtype)), tuple(p)) for l, p in zip(leaves, layouts)
        )
        out.append({names.params(k): spec(params, layout.params[k]), names.opt_state(k): spec(opt, layout.opt[k])})
        if fn.state is not None:
            out[-1][names.stage_state(k)] = spec(fn.state.leaves, [()] * len(fn.state.leaves))
    return out
