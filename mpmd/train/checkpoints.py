"""Checkpoints of a pipeline's state, keyed by parameter path, and recovery after a lost slice.

Every parameter and optimizer-state leaf is saved under its name (mpmd/stages/leaf_paths.py:
`params/blocks.3.mlp.up.kernel`, `opt/0.mu/blocks.3.mlp.up.kernel`, `opt/0.count`), once
(a tied weight held by two stages is saved by the first), by the slice that holds it, into
that slice's own Orbax directory `<run_dir>/checkpoints/<step>/slice_<r>.<generation>/`. The
step is committed by its manifest once every slice has finalized its saves
(runtime/worker/slice_store.py), and only by the controller;
the manifest records, per leaf, its shape, dtype and directory, plus the data position, the
step, what the math depends on (`partition`: microbatch count, clipping) and the layout
that saved it. Restore reads, on each slice of the new layout, just the leaves its stages
need from wherever they were saved (an Orbax partial restore), so a step restores onto any
layout: another number of stages, slices or virtual stages, another schedule or mesh. What
changes the math (the model's leaves, the optimizer's state, the partition) is refused.

A checkpoint from before leaves were keyed (a manifest without `format`, parts `stage_<k>`
holding bundles by position) restores only onto the very layout that saved it, and is
refused with a message saying so onto any other. Saves are asynchronous: every slice
snapshots a step's arrays at once (host memory; on CPU no copy at all), writes them in its
own background thread with one long-lived Orbax checkpointer, and the controller's commit
thread writes the manifests in step order as the slices report their parts finalized. Two
steps may be in flight; a third save waits for the oldest commit (a full queue blocks, it
never drops a save).

Restore is all or nothing: every slice reads its part of a step aside (a staged restore)
and every slice switches to it only once all have read theirs; otherwise the next older
committed step is tried. A step that fails is moved aside as damaged once an older one
restores. When committed steps exist but none restores, restore raises CheckpointError
naming each step and why: a run never starts over from step 0 over its own checkpoints.

Every leaf's digest (slice_store.digest, computed by the slice that wrote it, after the
write: CRC-32) is recorded in the manifest, and the manifest's sha256 beside it (manifest.sha256).
A restore checks both: a leaf read back otherwise, or a manifest that does not match, is
damage and handled as an unreadable step (skipped with a warning naming the part, i.e. the
slice that saved it, the leaf and the step; moved aside once an older step restores). A
step saved before digests were recorded restores unverified, with a line saying so. The
manifest also records whether the step's loss and gradient norm were finite (`finite`);
pruning keeps the newest finite, digested step whatever came after it.

Fencing. A part's directory is named for the cluster's generation when the save began
(`generation_tag`: runtime/control/client.py, "Generations"), and the manifest names the
directories it commits. A worker that was declared lost and replaced but still runs (a
"zombie": stopped, cut off, then back) finishes its write, if at all, into a directory of
its own generation, which no manifest names: it can never replace a part the controller
committed, nor share Orbax's temporary directory with the worker that replaced it.

A save that fails (a full or read-only disk) is retried once with the state at hand, then
raises CheckpointError: training stops after the last committed step instead of computing
steps it cannot keep. What a failed save wrote is removed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
import time

from mpmd.stages import names
from mpmd.stages.leaf_paths import StateNames
from mpmd.train.options import Checkpointing
from mpmd.runtime.worker.slice_store import CheckpointStore
from mpmd.runtime.control.cluster import WorkerLost

log = logging.getLogger("mpmd")


class Rewound(Exception):
    """Every slice was put back at the state after step `step`: a slice was lost (and
    replaced, or the run went on without it on the survivors), or a move back onto more
    slices restored an older checkpoint than the one it was waiting for.

    The caller rewinds its data to `data_state` (what it passed when that step was saved)
    and goes on: the steps after `step` are replayed, so each update lands exactly once.
    `why`: what happened, e.g. "recovered from slice 1 (worker ...) lost: ...; replaced".
    """

    def __init__(self, step: int, data_state, why: str, tier: str = "persistent", replayed: int = 0):
        super().__init__(f"{why}; resuming after step {step} ({TIERS[tier]}, {replayed} step(s) to replay)")
        self.step = step
        self.data_state = data_state
        self.tier = tier  # "memory", "persistent" or "initial": where the state came from
        self.replayed = replayed  # steps computed again: the failed one and those after `step`


TIERS = {
    "memory": "from the in-memory snapshot",
    "persistent": "from the persistent checkpoint",
    "initial": "from the initial state: nothing was saved yet",
}


class CheckpointError(RuntimeError):
    """The run's checkpoints cannot be used: no committed step restores, or saves keep failing."""


class NonFinite(RuntimeError):
    """Step `step`'s loss or gradient norm is not finite: it was not committed and training
    stopped (Recovery.on_nonfinite); `last` is the last committed step, kept."""

    def __init__(self, step: int, metrics: dict, last: int | None, why: str = ""):
        shown = ", ".join(f"{k} {metrics[k]}" for k in ("loss", "grad_norm") if k in metrics)
        super().__init__(
            f"step {step} has a non-finite {shown}{why}: it was not committed and training "
            f"stopped; the last committed step is {last if last is not None else 'none'} "
            f"(kept)"
        )
        self.step, self.last = step, last


FORMAT = 2  # manifests of leaves keyed by path; older ones have no "format"
# What a stage layout may change on resume (recorded in the manifest, logged when it changes).
LAYOUT_KEYS = ("num_stages", "num_slices", "schedule", "virtual_stages", "placement", "mesh")


class StageCheckpoints:
    """Saves and restores a pipeline's state; `names` (leaf_paths.StateNames) says what each
    stage's leaves are, `placement` (stage -> slice) where they live now, `partition` what a
    restored run must match, `layout` (LAYOUT_KEYS) how it is laid out (free to differ from
    the checkpoint's), `options` how many steps to keep, whether saves are asynchronous and
    how many may fail in a row. Built with another placement it restores the same steps onto
    it."""

    def __init__(
        self,
        run_dir,
        cluster,
        placement: tuple[int, ...],
        partition: dict,
        options: Checkpointing,
        layouts: dict | None = None,
        names: StateNames | None = None,
        layout: dict | None = None,
    ):
        assert names is not None and len(names.params) == len(placement), "names: one entry per stage"
        self.store = CheckpointStore(os.path.abspath(run_dir))  # workers may not share our cwd
        self.cluster = cluster
        self.placement = placement  # stage -> slice: which slice saves which stage
        self.num_slices = max(placement) + 1
        self.partition = partition  # what a restored run must match (the math)
        self.names = names
        self.layout = dict(layout or {})
        self._owner = self._owners()  # leaf name -> (buffer, index, stage) that saves it
        # {buffer: layout per array} on its slice's mesh: a restore lays the saved arrays out
        # so, whatever mesh saved them (Orbax reads each device's part).
        self.layouts = dict(layouts or {})
        self.keep = options.keep
        self.asynchronous = options.asynchronous
        self.digests = options.digests  # record leaf digests at save, check them at restore
        self.max_in_flight = 2  # steps saved but not yet committed
        self._cond = threading.Condition()
        self._in_flight: deque = deque()  # (step, {slice: directories}, manifest, t), oldest first
        self._committer: threading.Thread | None = None
        self._save_pool = ThreadPoolExecutor(self.num_slices, thread_name_prefix="mpmd-save")
        self._wait_pool = ThreadPoolExecutor(self.num_slices * self.max_in_flight, thread_name_prefix="mpmd-commit")
        self.last_save_s = {}
        self.max_failed_saves = options.max_failed_saves
        self.failed_saves = 0  # failed saves in a row
        self._failure: tuple[int, str] | None = None  # (step, why) of a failed save not yet retried
        # step -> WorkerLost of a step whose commit a lost slice prevented: a save waited for
        # raises it (its state went with the slice: the caller recovers and saves again).
        self._lost_commits: dict[int, BaseException] = {}
        # step -> the WorkerLost a recovery gave up on it for without waiting (abandon).
        self._abandoned: dict[int, BaseException] = {}

    def _owners(self) -> dict[str, tuple[str, int, int]]:
        """{leaf name: (buffer, index, stage)} of the first stage holding each leaf: who saves it."""
        out = {}
        for k in range(len(self.placement)):
            for buffer, leaves in self.names.buffers(k):
                for i, name in enumerate(leaves):
                    out.setdefault(name, (buffer, i, k))
        return out

    def _items(self, step: int, slice_index: int, tag: str) -> dict[str, dict[str, tuple[str, int]]]:
        """{this slice's directory: {leaf name: (buffer, index)}} of the leaves it saves
        (in generation `tag`)."""
        d = self.store.step_dir(step) / names.slice_dir(slice_index, tag)
        mine = {name: (b, i) for name, (b, i, k) in self._owner.items() if self.placement[k] == slice_index}
        return {str(d): mine} if mine else {}

    def _leaf_table(self, tag: str) -> dict[str, dict]:
        """The manifest's record of every leaf: shape, dtype, and the directory holding it
        (written in generation `tag`)."""
        return {
            name: {
                "shape": list(self.names.specs[name][0]),
                "dtype": self.names.specs[name][1],
                "part": names.slice_dir(self.placement[k], tag),
            }
            for name, (_, _, k) in sorted(self._owner.items())
        }

    def relayout(self, placement: tuple[int, ...], layouts: dict, layout: dict) -> None:
        """The stages moved (a run on fewer or more slices, same stages): from now on slice
        placement[k] saves stage k's leaves and restores what its stages need, laid out as
        `layouts` says; `layout` is recorded in the manifests from now on. Leaves are keyed by
        path, so any committed step restores onto the new placement; `partition` (the math)
        stays. Call with no save in flight (wait()); the thread pools keep the size they were
        made with (the configured slices: a run never grows past them)."""
        assert not self._in_flight, "relayout with a save in flight"
        self.placement, self.num_slices = tuple(placement), max(placement) + 1
        self.layouts, self.layout = dict(layouts), dict(layout)

    def save(self, step: int, data_state, extra: dict, wait: bool = False) -> None:
        """Snapshot every stage at `step` (all slices at once) and return; the slices write in
        the background and the step is committed once all of them finalized. At most
        `max_in_flight` steps are being written: a further save blocks until the oldest is
        committed (never dropped). Synchronous when `wait` or asynchronous=False.

        A save that failed before (found here) or fails now while waited for is retried with
        the state at hand until max_failed_saves retries are spent; then CheckpointError."""
        while True:
            self._check_failures()
            if step not in self.store.committed() and step not in self.steps_in_flight():
                with self._cond:
                    while len(self._in_flight) >= self.max_in_flight:
                        self._cond.wait()
                self._save(step, data_state, extra)
            if self.asynchronous and not wait:  # committed in the background
                return
            self.wait()
            with self._cond:
                lost = self._lost_commits.pop(step, None)
            if lost is not None:
                raise lost
            if self._failure is None:
                return

    def failed(self) -> bool:
        """Whether a save failed and awaits its retry (a save still in flight may yet fail)."""
        return self._failure is not None

    def _check_failures(self) -> None:
        """Raise CheckpointError once more than max_failed_saves saves after a failed one
        failed too (saves in a row; one already in flight when a failure is found counts);
        otherwise let the next save retry."""
        with self._cond:
            if self._failure is None:
                return
            step, why = self._failure
            if self.failed_saves > self.max_failed_saves:
                last = self.latest()
                raise CheckpointError(
                    f"checkpoint of step {step} failed: {why} ({self.failed_saves} saves in a row "
                    f"failed, max_failed_saves={self.max_failed_saves}); stopped, the last committed "
                    f"step is {last if last is not None else 'none'}"
                )
            self._failure = None
        log.warning("checkpoint of step %d failed (%s); retrying", step, why)

    def _failed(self, step: int, error: BaseException) -> None:
        why = _short(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        self.store.discard(step)
        with self._cond:
            self.failed_saves += 1
            self._failure = (step, why)

    def steps_in_flight(self) -> list[int]:
        with self._cond:
            return [item[0] for item in self._in_flight]

    def abandon(self, lost: BaseException) -> None:
        """The run recovers from `lost` (a WorkerLost) without waiting for the saves in flight:
        none can commit, and the lost slice's replacement, asked for a part it never started,
        counts as `lost`, not as a failed save. They leave the queue in the background."""
        with self._cond:
            for item in self._in_flight:
                self._abandoned[item[0]] = lost

    def _save(self, step: int, data_state, extra: dict) -> None:
        t0 = time.perf_counter()
        try:
            self.store.prepare(step)
        except Exception as e:  # the controller cannot write (EROFS, ENOSPC, ...)
            self._failed(step, e)
            return
        # Every slice snapshots at once; each returns as soon as its arrays are in host memory.
        tag = self.cluster.generation_tag  # one generation's directories for the whole step
        items = {r: self._items(step, r, tag) for r in range(self.num_slices)}
        futures = {r: self._save_pool.submit(self.cluster.save, r, items[r], self.digests) for r in items}
        errors = {r: f.exception() for r, f in futures.items()}
        lost = [e for e in errors.values() if isinstance(e, WorkerLost)]
        if lost:
            raise lost[0]
        failed = [e for e in errors.values() if e is not None]
        started = {r: list(items[r]) for r, e in errors.items() if e is None}
        if failed:  # a slice could not start (a missing buffer, a directory refused)
            self._wait_all(started)
            self._failed(step, failed[0])
            return
        manifest = {
            "format": FORMAT,
            "partition": self.partition,
            "layout": self.layout,
            "leaves": self._leaf_table(tag),
            "scoped": self.names.scoped,
            "data_state": data_state,
            **extra,
        }
        self.last_save_s = {"snapshot_s": time.perf_counter() - t0}
        with self._cond:
            self._in_flight.append((step, started, manifest, time.perf_counter()))
            if self._committer is None:
                self._committer = threading.Thread(target=self._commit_loop, daemon=True, name="mpmd-commit")
                self._committer.start()
            self._cond.notify_all()
        if not self.asynchronous:
            self.wait()

    def _commit_loop(self) -> None:
        """Commit the saved steps in order, each once every slice finalized its parts: the
        manifests appear in step order, never one whose parts are not all on disk."""
        while True:
            with self._cond:
                while not self._in_flight:
                    self._cond.wait()
                step, started, manifest, t1 = self._in_flight[0]
            try:
                digests = self._wait_all(started, raise_first=True, step=step)
                self.store.commit(step, with_digests(manifest, digests))
            except WorkerLost as e:  # a slice died while writing: this step stays uncommitted
                log.warning("checkpoint of step %d not committed: %s", step, e)
                with self._cond:
                    self._lost_commits[step] = e
            except Exception as e:
                self._failed(step, e)
            else:
                with self._cond:
                    self.failed_saves = 0
                    self._lost_commits = {s: e for s, e in self._lost_commits.items() if s > step}
                    superseded = self._failure if self._failure is not None and self._failure[0] < step else None
                    if superseded is not None:
                        self._failure = None  # a newer step is committed: nothing to retry
                if superseded is not None:  # no retry will say it: say it here
                    log.warning(
                        "checkpoint of step %d failed (%s); step %d is committed in its place", *superseded, step
                    )
                try:
                    self.store.prune(self.keep)
                except OSError as e:
                    log.warning("could not prune old checkpoints: %s", e)
                self.last_save_s["finalize_s"] = time.perf_counter() - t1
            with self._cond:
                self._in_flight.popleft()
                self._cond.notify_all()

    def _losses(self, step, errors: list) -> list:
        """The WorkerLosts among the slices' `errors` for `step`; where there is none but some
        error, and the step was abandoned (abandon), the loss it was abandoned for: the lost
        slice's replacement was asked for a part it never started."""
        with self._cond:
            abandoned = self._abandoned.pop(step, None)
        return [e for e in errors if isinstance(e, WorkerLost)] or ([abandoned] if abandoned and any(errors) else [])

    def _wait_all(self, started: dict[int, list[str]], raise_first: bool = False, step=None) -> dict[str, str]:
        """Until every slice's saves of these directories are finalized or failed (the slices
        concurrently): {leaf name: digest} of all of them; the first error, if asked, once
        all are done: a failed step is removed only when nobody writes it."""
        futures = [self._wait_pool.submit(self.cluster.wait_saves, r, dirs) for r, dirs in started.items()]
        errors = [f.exception() for f in futures]
        lost = self._losses(step, errors)
        first = (lost or [e for e in errors if e is not None] or [None])[0]
        if raise_first and first is not None:
            raise first
        return {
            key: d
            for f, e in zip(futures, errors)
            if e is None
            for part in f.result().values()
            for key, d in part.items()
        }

    def wait(self) -> None:
        """Until every save in flight is committed (or failed)."""
        with self._cond:
            while self._in_flight:
                self._cond.wait()

    def latest(self) -> int | None:
        steps = self.store.committed()
        return steps[-1] if steps else None

    def restore_latest(self):
        """Restore every slice from the newest committed step that restores on all of them.

        Returns (step, manifest), or None when there is no checkpoint at all. A step whose
        manifest does not match this pipeline raises ValueError; a damaged step is skipped
        with a warning naming it, and moved aside once an older step restored. CheckpointError
        when checkpoints exist but none restores (nothing is moved then).
        """
        self.wait()
        failed = dict(self.store.damaged())  # step -> why
        for step, why in failed.items():
            log.warning("skipping checkpoint step %d: %s", step, why)
        for step in reversed(self.store.committed()):
            manifest = self.store.manifest(step)
            self._check(step, manifest)
            why = self._restore_all(step, manifest)
            if why is None:
                for bad, bad_why in failed.items():
                    self.store.quarantine(bad, bad_why)
                if (
                    self.digests
                    and "format" in manifest
                    and not all("digest" in leaf for leaf in manifest["leaves"].values())
                ):
                    log.warning(
                        "checkpoint step %d has no digests (saved before mpmd recorded them): restored unverified", step
                    )
                return step, manifest
            log.warning("skipping checkpoint step %d: %s", step, why)
            failed[step] = why
        if failed:
            steps = "; ".join(f"step {s}: {_short(w)}" for s, w in sorted(failed.items(), reverse=True))
            raise CheckpointError(
                f"no checkpoint in {self.store.root} can be restored ({steps}); "
                f"nothing was trained or changed: move the damaged steps away or "
                f"use another run_dir"
            )
        aside = self.store.quarantined()
        if aside:
            raise CheckpointError(
                f"{self.store.root} holds only checkpoints set aside as damaged "
                f"({', '.join(p.name for p in aside)}); refusing to start over "
                f"from step 0 over them: remove them or use another run_dir"
            )
        return None

    def check_newest(self) -> None:
        """ValueError if the newest committed step does not fit this run (see _check): found
        before any worker starts. Restore checks every step it tries again."""
        steps = self.store.committed()
        if steps:
            self._check(steps[-1], self.store.manifest(steps[-1]))

    def _check(self, step: int, manifest: dict) -> None:
        """ValueError unless `manifest` holds this run's math: the same leaves (names, shapes,
        dtypes: model and optimizer state) and partition. The layout may differ, except for
        a checkpoint from before leaves were keyed, which fits only the layout that saved it."""
        where = f"checkpoint step {step} in {self.store.root}"
        if "format" not in manifest:
            saved, now = manifest.get("partition") or {}, self._legacy_partition()
            if saved == now:
                return
            if any(saved.get(k) != now[k] for k in now if k != "params"):
                raise ValueError(
                    f"{where} was saved before checkpoints were keyed by parameter path: it "
                    f"holds each stage's leaves by position, so it restores only onto the layout "
                    f"that saved it ({describe_layout(saved)}); this run is "
                    f"{describe_layout(self.layout)}. Resume once with that layout (its next "
                    f"checkpoint is keyed by path and restores onto any layout), or use another run_dir"
                )
            raise ValueError(
                f"{where} (saved before checkpoints were keyed by parameter path) holds other "
                f"parameter shapes than this run's: resume with the same model, or use another run_dir"
            )
        if manifest["format"] != FORMAT:
            raise ValueError(f"{where} has checkpoint format {manifest['format']!r}; this mpmd reads format {FORMAT}")
        changed = [
            f"{k}: {manifest['partition'].get(k, '(unset)')!r} -> {self.partition.get(k, '(unset)')!r}"
            for k in sorted(set(manifest["partition"]) | set(self.partition))
            if manifest["partition"].get(k, "(unset)") != self.partition.get(k, "(unset)")
        ]
        if changed:
            raise ValueError(
                f"{where} was trained with other settings that change the math "
                f"({'; '.join(changed)}); resume with the same values or use another run_dir "
                f"(the layout may change: {', '.join(LAYOUT_KEYS)})"
            )
        saved = manifest["leaves"]
        saved_stages = manifest.get("layout", {}).get("num_stages")
        if (self.names.scoped or manifest.get("scoped")) and saved_stages != len(self.placement):
            raise ValueError(
                f"{where} was saved with {saved_stages} stages, this run has {len(self.placement)}: "
                f"stages given as plain nnx.Modules name their leaves within their stage "
                f"(params/stage1/...), so their checkpoints restore only onto the same stages. "
                f"Cut the model with mpmd.split (leaves named by model path) to change the "
                f"stage count, or resume with {saved_stages} stages"
            )
        now = self.names.specs
        problems = [
            f"missing from the checkpoint: {_few(sorted(set(now) - set(saved)))}" if set(now) - set(saved) else "",
            f"in the checkpoint but not in this run: {_few(sorted(set(saved) - set(now)))}"
            if set(saved) - set(now)
            else "",
            _few(
                [
                    f"{n} saved {tuple(saved[n]['shape'])} {saved[n]['dtype']}, now {tuple(now[n][0])} {now[n][1]}"
                    for n in sorted(set(now) & set(saved))
                    if (list(now[n][0]), now[n][1]) != (saved[n]["shape"], saved[n]["dtype"])
                ]
            ),
        ]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(
                f"{where} holds another model or optimizer state than this run "
                f"({'; '.join(problems)}): resume with the same model and optimizer, or use "
                f"another run_dir"
            )

    def _legacy_partition(self) -> dict:
        """What a checkpoint from before leaves were keyed recorded as its partition."""
        return {
            **{k: self.layout.get(k) for k in ("num_stages", "num_slices", "schedule", "virtual_stages")},
            "params": [[list(self.names.specs[n][0]) for n in stage] for stage in self.names.params],
        }

    def _restore_items(self, step: int, manifest: dict, slice_index: int) -> dict:
        """What slice `slice_index` reads: {directory: {leaf name: [(buffer, index), ...]}},
        every leaf its stages hold, from the directory that saved it; for a checkpoint from
        before leaves were keyed, its stages' whole bundles {stage directory: [buffers]}."""
        d = self.store.step_dir(step)
        stages = [k for k, r in enumerate(self.placement) if r == slice_index]
        if "format" not in manifest:
            return {str(d / names.stage_dir(k)): [names.params(k), names.opt_state(k)] for k in stages}
        out: dict[str, dict[str, list]] = {}
        for k in stages:
            for buffer, leaves in self.names.buffers(k):
                for i, name in enumerate(leaves):
                    part = str(d / manifest["leaves"][name]["part"])
                    out.setdefault(part, {}).setdefault(name, []).append((buffer, i))
        return out

    def _restore_all(self, step: int, manifest: dict) -> str | None:
        """Stage `step` on every slice, then switch every slice to it; or switch none and say why."""
        slices = range(self.num_slices)

        def read(r: int) -> None:
            layouts = {
                n: self.layouts[n]
                for k, s in enumerate(self.placement)
                if s == r
                for n, _ in self.names.buffers(k)
                if n in self.layouts
            }
            items = self._restore_items(step, manifest, r)
            digests = (
                {
                    name: leaf["digest"]
                    for name, leaf in manifest.get("leaves", {}).items()
                    if "digest" in leaf and any(name in keys for keys in items.values())
                }
                if self.digests
                else {}
            )
            self.cluster.restore(r, items, staged=True, layouts=layouts, digests=digests)

        # Every slice reads its leaves at once (each from the directories that hold them).
        errors = [f.exception() for f in [self._save_pool.submit(read, r) for r in slices]]
        lost = self._losses(step, errors)
        if lost:
            raise lost[0]  # the slice is gone, not the checkpoint
        failed = [e for e in errors if e is not None]
        if failed:
            for r in slices:
                self.cluster.finish_restore(r, commit=False)
            return str(failed[0])
        for r in slices:
            self.cluster.finish_restore(r, commit=True)
        return None


def with_digests(manifest: dict, digests: dict[str, str]) -> dict:
    """`manifest` with each leaf's digest ({leaf name: digest}, as the slices reported them)
    in its entry of the leaf table."""
    leaves = {
        name: {**leaf, **({"digest": digests[name]} if name in digests else {})}
        for name, leaf in manifest["leaves"].items()
    }
    return {**manifest, "leaves": leaves}


def describe_layout(layout: dict) -> str:
    """'2 stages on 2 slices, 1f1b, 1 virtual stage per slice, mesh data=1 x fsdp=1 x tensor=1'."""
    parts = [
        f"{layout.get('num_stages')} stages on {layout.get('num_slices')} slices",
        str(layout.get("schedule")),
        f"{layout.get('virtual_stages')} virtual stage(s) per slice",
    ]
    meshes = layout.get("mesh")
    if meshes:
        parts.append("mesh " + (meshes[0] if len(set(meshes)) == 1 else " | ".join(meshes)))
    return ", ".join(parts)


def _few(items: list[str], limit: int = 4) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _short(why: str, limit: int = 400) -> str:
    """A reason fit for a one-line message: tensorstore's spec dropped, the middle of a long
    one cut (its start says what failed, its end the OS error)."""
    why = why.split(" [tensorstore_spec=")[0]
    return why if len(why) <= limit else f"{why[: limit // 2]} ... {why[-limit // 2 :]}"
