"""A group's slices as a Cluster of their own, so a Trainer can run on one group while
programs run on others (mpmd/groups/client.py): the Trainer is one client of the groups.

    groups = Groups(mpmd.LocalCluster(3), {"learner": [{}, {}], "sampler": {}})
    trainer = mpmd.Trainer(pipeline, optax.sgd(0.1), groups.cluster_for("learner"))
    params = param_handles(trainer, groups, "learner")   # mpmd/rl/sync.py: a handle per stage
    on_sampler = [groups.move(h, "sampler") for h in params]

Slice i of the view is slice `group.slices[i]` of the cluster. What the Trainer installs,
puts, saves and restores goes to that slice; its plans are installed under its own names on
every other slice too, empty, since a run runs on every slice of the cluster; transfers in its
streams name view slices and are renamed to the cluster's. Its runs take their ids from the
Groups client and are collected in the one order every run is collected in (Call).

`start` starts nothing: the Groups client started every slice, and the view only checks that
the Trainer asks for the group's slices and meshes. `close` leaves the cluster up (the
Groups client closes it). A group's slices cannot shrink or grow (`remove`, `add`: refused,
so a loss is recovered by replacement, never elastically).
"""

from __future__ import annotations

import os

import numpy as np

from typing import TYPE_CHECKING

from mpmd.runtime.control.cluster import PeerLost, ReplaceUnsupported, WorkerLost
from mpmd.runtime.worker.instructions import Recv, Send
from mpmd.runtime.worker.streams import PackedStream
from mpmd.stages import sharding

if TYPE_CHECKING:  # the Groups client makes these views (Groups.cluster_for)
    from mpmd.groups.client import Group, Groups


class GroupCluster:
    """The Cluster protocol (runtime/control/cluster.py) over one group's slices."""

    def __init__(self, groups: Groups, group: Group):
        self._groups, self.group = groups, group
        self._global = np.asarray(group.slices, np.int32)
        self._plans: set[str] = set()  # plan names installed (empty) on the other slices

    # -- what the cluster is -------------------------------------------------------------------
    @property
    def num_slices(self) -> int:
        return len(self.group.slices)

    @property
    def devices_per_slice(self) -> int | None:
        return None  # each slice has its group's mesh; `start` checks the Trainer's against it

    @property
    def generation_tag(self) -> str:
        return self._groups.cluster.generation_tag

    def start(self, num_slices: int, root: str | None = None, meshes=None) -> None:
        g = self.group
        if num_slices != len(g.slices):
            raise ValueError(
                f"group {g.name!r} has {len(g.slices)} slice(s) but the run asks for {num_slices}: "
                f"give the group one mesh per slice of the schedule"
            )
        asked = sharding.slice_meshes(meshes, num_slices)
        if tuple(asked) != g.meshes:
            raise ValueError(
                f"group {g.name!r} has meshes {[sharding.describe(m) for m in g.meshes]} but the run asks "
                f"for {[sharding.describe(m) for m in asked]}: give the run the group's meshes"
            )
        have = self._groups.root
        if root is not None and (have is None or os.path.commonpath([have, os.path.abspath(root)]) != have):
            raise ValueError(
                f"the run saves under {root!r} but the groups' workers are confined to {have!r}: "
                f"start the Groups with a root that holds the run's directory"
            )

    def close(self) -> None:
        """Nothing: the Groups client owns the cluster."""

    # -- state on one slice --------------------------------------------------------------------
    def _at(self, slice_index: int) -> int:
        return self.group.slices[slice_index]

    def _verb(self, verb, slice_index, *args):
        """A verb of the cluster to one slice of the view, a loss raised as seen here."""
        return self._mapped_loss(lambda: verb(self._at(slice_index), *args))

    def load_programs(self, slice_index, specs) -> None:
        self._verb(self._groups.cluster.load_programs, slice_index, specs)

    def install_plan(self, slice_index, name, stream) -> None:
        plan = self._plan(name)
        self._verb(self._groups.cluster.install_plan, slice_index, plan, self._renamed(stream))
        if plan not in self._plans:  # a run runs on every slice: the others need the name too
            others = [r for r in range(len(self._groups.meshes)) if r not in self.group.slices]
            self._mapped_loss(lambda: [self._groups.cluster.install_plan(r, plan, []) for r in others])
            self._plans.add(plan)

    def put(self, slice_index, name, arrays, layouts=None, append=False) -> None:
        self._verb(self._groups.cluster.put, slice_index, name, arrays, layouts, append)

    def get(self, slice_index, names_):
        return self._verb(self._groups.cluster.get, slice_index, names_)

    def delete(self, slice_index, names_) -> None:
        self._verb(self._groups.cluster.delete, slice_index, names_)

    def save(self, slice_index, items, digests=True) -> None:
        self._verb(self._groups.cluster.save, slice_index, items, digests)

    def wait_saves(self, slice_index, directories=None):
        return self._verb(self._groups.cluster.wait_saves, slice_index, directories)

    def restore(self, slice_index, items, staged=False, layouts=None, digests=None) -> None:
        self._verb(self._groups.cluster.restore, slice_index, items, staged, layouts, digests)

    def finish_restore(self, slice_index, commit) -> None:
        self._verb(self._groups.cluster.finish_restore, slice_index, commit)

    # -- runs ----------------------------------------------------------------------------------
    def launch(self, plan, run, feeds, fetch, trace=False) -> "_GroupRun":
        """The run with the Groups client's next id (`run`, the Trainer's count, is not used:
        ids must not repeat across the clients sharing the cluster)."""
        call = self._groups.launch(
            self._plan(plan),
            {self._at(r): f for r, f in feeds.items()},
            {self._at(r): f for r, f in fetch.items()},
            trace,
        )
        return _GroupRun(self, call)

    def run(self, plan, run, feeds, fetch, trace=False):
        return self.launch(plan, run, feeds, fetch, trace).result()

    # -- losses --------------------------------------------------------------------------------
    def replace(self, slice_index, wait_s=None) -> None:
        self._mapped_loss(lambda: self._groups.replace(self._at(slice_index), force=True))

    def remove(self, slice_index, meshes=None) -> None:
        raise ReplaceUnsupported(f"group {self.group.name!r} cannot go on without a slice: its slices are fixed")

    def add(self, meshes=None, before_reset=None) -> None:
        raise ReplaceUnsupported(f"group {self.group.name!r} cannot grow: its slices are fixed")

    def _mapped_loss(self, call):
        """`call()`, a loss raised as seen here: of one of this group's slices, under the view's
        index (the Trainer replaces it); of another group's slice (or a run discarded by one),
        PeerLost once that slice has its new worker (the Trainer only restores)."""
        try:
            return call()
        except Exception as e:
            lost = self._groups.loss_of(e)
            if lost is None or lost.slice_index is None:
                raise
            if lost.slice_index in self.group.slices:
                raise WorkerLost(self.group.slices.index(lost.slice_index), lost.address, str(lost)) from e
            self._groups.replace(lost.slice_index)
            raise PeerLost(lost.slice_index, lost.address, str(lost)) from e

    # -- names ---------------------------------------------------------------------------------
    def _plan(self, name: str) -> str:
        return f"{self.group.name}/{name}"

    def _renamed(self, stream):
        """The stream with its transfers' peers renamed from view slices to the cluster's."""
        if isinstance(stream, PackedStream):
            peer = stream.peer.copy()
            moves = np.array([isinstance(t, (Send, Recv)) for t in stream.templates], bool)
            rows = moves[stream.op] if len(stream.op) else np.zeros(0, bool)
            peer[rows] = self._global[peer[rows]]
            return PackedStream(
                stream.templates, stream.op, stream.k, stream.j, stream.q, peer, stream.post, stream.keep, stream.window
            )
        return [
            ins._replace(dst=self._at(ins.dst))
            if isinstance(ins, Send)
            else ins._replace(src=self._at(ins.src))
            if isinstance(ins, Recv)
            else ins
            for ins in stream
        ]


class _GroupRun:
    """A run of the view: its results are those of the group's slices, in view order."""

    def __init__(self, view: GroupCluster, call):
        self._view, self._call = view, call

    @property
    def run(self) -> int:
        return self._call.run

    def result(self):
        results = self._view._mapped_loss(self._call.result)
        return [results[r] for r in self._view.group.slices]
