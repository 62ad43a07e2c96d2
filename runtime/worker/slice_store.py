"""Each slice's Orbax store of its own buffers (SliceCheckpointer), and the directory layout the
controller commits them under (CheckpointStore). The Trainer's side, which tiers and commits
checkpoints, is mpmd/train/checkpoints.py.

Layout under the run directory:
    checkpoints/<step>/<part>/        one Orbax checkpoint per part (the frontend uses one per
                                      stage: "stage_<k>"), written by the slice that holds it
    checkpoints/<step>/manifest.json  written by the controller, atomically, only after every
                                      slice reported its saves finalized: the commit record

    checkpoints/<step>/manifest.sha256 the manifest's own digest, written just before it

Digests. Each slice digests every leaf it saves (DIGEST: CRC-32 of the array's bytes in C
order, in its writer thread, after the write: the step is not held up) and reports them with
the finalized saves; the controller records them in the manifest, and the manifest's digest
beside it. A restore digests what Orbax read back and refuses a leaf that does not match
(Damaged), as it refuses a manifest that does not match its digest. A leaf spread over several
processes of a gang (not addressable in one) is not digested and restores unverified, as do
checkpoints written before digests were recorded.

A step directory without a manifest is not a checkpoint (a save was interrupted) and is never
restored; a committed step is never written again. Orbax itself writes each part into a
temporary directory and renames it when finalized, so a killed save leaves no part that looks
complete.

Confinement. A worker saves and restores only under the root it was started with (`mpmd
worker --root`); `confine` resolves every directory a Save or Restore names (symlinks, "..",
relative to the worker's cwd) and refuses one outside the root before Orbax touches it.
Orbax deletes one thing on its own, `<directory>.orbax-checkpoint-tmp` (an earlier save's
leftover), which lies beside the directory: inside the root too, since the directory must be
strictly below it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import zlib
from pathlib import Path

import jax

from mpmd.runtime.worker import failpoints

log = logging.getLogger("mpmd.checkpoint")
MANIFEST = "manifest.json"
MANIFEST_DIGEST = "manifest.sha256"  # hex sha256 of manifest.json's bytes
# A leaf's digest: "<algorithm>:<hex>" of its bytes in C order. CRC-32 (zlib, ~2.4 GB/s on
# one core here, against ~0.9 for sha256) is what saves write: the threat is accidental damage
# (bit rot, torn writes), which it catches (every burst of <= 32 bits, else all but 2**-32),
# not an adversary, who could rewrite any digest alike. A restore checks a leaf with the
# algorithm its digest names, so sha256 digests verify too.
DIGEST = "crc32"
_HASHES = {"crc32": lambda data: f"{zlib.crc32(data):08x}", "sha256": lambda data: hashlib.sha256(data).hexdigest()}


ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # what Orbax appends to a directory it is writing


# Orbax keeps process-wide state: two saves running at once in one process (slices of the
# in-process cluster) collide on their temporary directories. Each worker process writes alone.
_ORBAX = threading.Lock()


def host_copy(array: jax.Array) -> jax.Array:
    """`array` in host memory, fit to outlive the next step: on CPU the array itself (host
    memory already; arrays are immutable and the runtime never donates them, so an update
    makes new ones and the snapshot costs no copy), elsewhere a copy to pinned host memory on
    the same devices."""
    if all(d.platform == "cpu" for d in array.sharding.device_set):
        return array
    return jax.device_put(array, array.sharding.with_memory_kind("pinned_host"))


def digest(array, algorithm: str = DIGEST) -> str | None:
    """ "<algorithm>:<hex>" of `array`'s bytes in C order (the host bytes Orbax writes and
    reads back), or None when no one process holds all of it (a leaf spread over a gang)."""
    import numpy as np

    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        host = np.asarray(array)
    elif array.sharding.is_fully_replicated:
        host = np.asarray(array.addressable_data(0))
    else:
        return None
    host = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    return f"{algorithm}:{_HASHES[algorithm](host)}"


class Damaged(ValueError):
    """What a restore read does not match the digest recorded when it was saved."""


def _check(array, expected: str) -> str | None:
    """The digest `array` has, when it is not `expected` (by the algorithm `expected` names);
    None when it matches or cannot be digested here."""
    algorithm = expected.split(":", 1)[0]
    if algorithm not in _HASHES:
        return f"{algorithm}: unknown digest"
    got = digest(array, algorithm)
    return None if got in (expected, None) else got


class OutsideRoot(ValueError):
    """A Save or Restore named a directory outside the worker's root; the message names both."""


WORKER_ROOT = "this worker's root"


def confine(items: dict[str, list[str]], root: str, whose: str = WORKER_ROOT) -> dict[str, list[str]]:
    """`items` ({directory: [buffer names]}) with every directory resolved to its real path;
    OutsideRoot if any is not strictly below `root` (itself resolved), or its Orbax temporary
    directory is not (a symlink planted there)."""
    real_root = os.path.realpath(root)
    out = {}
    for directory, names in items.items():
        real = os.path.realpath(directory)
        for path in (real, os.path.realpath(real + ORBAX_TMP_SUFFIX)):
            if path == real_root or os.path.commonpath([path, real_root]) != real_root:
                why = (
                    "a worker saves and restores only below the root it was started with (mpmd worker --root DIR)"
                    if whose == WORKER_ROOT
                    else "a job's session saves and restores only below the root its OpenSession gave"
                )
                raise OutsideRoot(
                    f"checkpoint directory {directory!r} (really {path}) is outside {whose} {real_root}: {why}"
                )
        out[real] = names
    return out


class SliceCheckpointer:
    """A slice's side: asynchronous Orbax saves of named buffers, and restores.

    A save takes a snapshot (`host_copy`: on CPU the arrays themselves, which are immutable
    and never donated; elsewhere a copy to host memory) and returns; one long-lived writer
    thread writes the queued snapshots in order with one long-lived Orbax checkpointer, then
    digests each single-array entry (`digest`; off with digests=False). At
    most `max_queued` saves wait or are being written: a further save blocks until the oldest
    is finalized (a full queue never drops a save). Each directory's outcome (finalized, or
    the error that stopped it) is kept until `wait` reports it.
    """

    def __init__(self, max_queued: int = 2):
        self._cond = threading.Condition()
        self._queue: list[tuple[str, dict]] = []  # (directory, host tree), oldest first
        self._writing: str | None = None
        self._done: dict[str, BaseException | dict] = {}  # directory -> {key: digest} (finalized) or error
        self._max_queued = max_queued
        self._writer: threading.Thread | None = None
        self._checkpointer = None
        self._closed = False

    def save(self, items: dict[str, dict], digests: bool = True) -> None:
        """Snapshot {directory: {key: array, or a bundle (list of arrays)}} and queue its
        write (and, with `digests`, the digest of each single array); blocks while the queue
        is full."""
        for directory, entries in items.items():
            tree = {
                key: [host_copy(a) for a in v] if isinstance(v, (list, tuple)) else host_copy(v)
                for key, v in entries.items()
            }
            with self._cond:
                while len(self._queue) + (self._writing is not None) >= self._max_queued:
                    self._cond.wait()
                self._done.pop(directory, None)
                self._queue.append((directory, tree, digests))
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_loop, daemon=True, name="mpmd-ckpt-writer")
                    self._writer.start()
                self._cond.notify_all()

    def _write_loop(self) -> None:
        import orbax.checkpoint as ocp

        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed, and every queued save written
                    self._writer = None
                    return
                directory, tree, digests = self._queue.pop(0)
                self._writing = directory
            if failpoints.armed:
                failpoints.hit("save", f"writing {directory}")
            outcome: BaseException | dict = {}
            try:
                with _ORBAX:  # one Orbax write at a time in a process (see _ORBAX)
                    if self._checkpointer is None:
                        self._checkpointer = ocp.StandardCheckpointer()
                    # An AsyncCheckpointer: save returns once the write started, so wait for
                    # its finalize (the rename that makes the part look complete) here.
                    self._checkpointer.save(os.path.abspath(directory), tree)
                    self._checkpointer.wait_until_finished()
                if digests:  # of the snapshot written, outside the Orbax lock
                    outcome = {
                        key: d for key, a in tree.items() if not isinstance(a, list) and (d := digest(a)) is not None
                    }
            except BaseException as e:  # ENOSPC, EROFS, ...: reported by wait, not raised here
                outcome = e
            with self._cond:
                self._writing = None
                self._done[directory] = outcome
                self._cond.notify_all()

    def close(self) -> None:
        """Let the writer thread end once the saves queued so far are written (a closed
        session's worker thread does not linger)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def pending(self) -> list[str]:
        """Directories queued or being written."""
        with self._cond:
            return [item[0] for item in self._queue] + ([self._writing] if self._writing else [])

    def wait(self, directories=None) -> dict[str, dict[str, str]]:
        """Block until `directories` (default: every save started so far) are finalized on
        disk; {directory finalized: {key: digest}}, each reported once. Raises the first write
        error among them (the others' outcomes are dropped: the caller discards the step)."""
        with self._cond:
            queued = {item[0] for item in self._queue}
            wanted = (
                set(directories)
                if directories is not None
                else (set(self._done) | queued | ({self._writing} if self._writing else set()))
            )
            unknown = wanted - set(self._done) - queued - {self._writing}
            if unknown:
                raise ValueError(f"no save of {sorted(unknown)} was started on this slice")
            while not wanted <= set(self._done):
                self._cond.wait()
            outcomes = {d: self._done.pop(d) for d in wanted}
        errors = [e for e in outcomes.values() if isinstance(e, BaseException)]
        if errors:
            raise errors[0]
        return dict(sorted(outcomes.items()))

    def restore(self, items: dict, sharding_of, digests: dict | None = None) -> dict[str, tuple]:
        """Read buffers from Orbax directories, array i of buffer `name` laid out as
        `sharding_of(name, i)` (Orbax reads only the shards each device needs, whatever mesh
        saved them). Each directory's entry is either [buffer name] (whole bundles saved under
        those names) or {key: [[buffer, index], ...]}: the leaf saved under `key` becomes
        array `index` of each listed buffer, and only those keys are read (a partial
        restore). Raises ValueError naming a missing or unreadable part, or a buffer whose
        arrays are not all given; Damaged naming the part and the key of a leaf read back
        other than `digests` ({key: digest} recorded at its save; a key without is not checked)
        says."""
        out: dict[str, tuple] = {}
        keyed: dict[str, dict[int, jax.Array]] = {}
        for directory, wanted in items.items():
            if isinstance(wanted, dict):
                for key, array in self._read(directory, wanted, sharding_of).items():
                    expected = (digests or {}).get(key)
                    if expected is not None and (got := _check(array, expected)) is not None:
                        raise Damaged(
                            f"checkpoint part {directory}: leaf {key!r} does not match the digest "
                            f"recorded at its save (read {got[:19]}, saved {expected[:19]}): the "
                            f"data on disk is damaged"
                        )
                    for buffer, index in wanted[key]:
                        keyed.setdefault(buffer, {})[index] = _laid_out(array, sharding_of(buffer, index))
            else:
                tree = self._read(directory, None, sharding_of)
                for name in wanted:
                    if name not in tree:
                        raise ValueError(f"checkpoint part {directory} has no buffer {name!r}; has {sorted(tree)}")
                    out[name] = tuple(tree[name])
        for buffer, arrays in keyed.items():
            if sorted(arrays) != list(range(len(arrays))) or buffer in out:
                raise ValueError(
                    f"restore of buffer {buffer!r} names arrays {sorted(arrays)}: each of "
                    f"0..n-1 exactly once, from one kind of entry"
                )
            out[buffer] = tuple(arrays[i] for i in range(len(arrays)))
        return out

    def _read(self, directory: str, keys, sharding_of) -> dict:
        """The saved tree of `directory`: all of it (keys None; bundles laid out by name), or
        only `keys` ({key: [[buffer, index], ...]}), each laid out as its first target."""
        import orbax.checkpoint as ocp

        if not os.path.isdir(directory):
            raise ValueError(f"checkpoint part {directory} does not exist")
        path = os.path.abspath(directory)
        with _ORBAX, ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ck:
            try:
                # Restore onto this slice's mesh whatever devices saved it (the saved
                # sharding names a topology this process may not have).
                meta = ck.metadata(path).item_metadata
                meta = getattr(meta, "tree", meta)
            except Exception as e:  # Orbax/tensorstore raise assorted errors on damaged files
                raise _unreadable(directory, e) from None
            if keys is None:
                target = {
                    name: [_spec(m, sharding_of(name, i)) for i, m in enumerate(leaves)]
                    for name, leaves in meta.items()
                }
            else:
                missing = sorted(set(keys) - set(meta))
                if missing:
                    raise ValueError(f"checkpoint part {directory} has no leaf {missing[0]!r} ({len(missing)} missing)")
                target = {key: _spec(meta[key], sharding_of(*targets[0])) for key, targets in keys.items()}
            try:
                return ck.restore(
                    path,
                    args=ocp.args.PyTreeRestore(
                        item=target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        partial_restore=keys is not None,
                    ),
                )
            except Exception as e:
                raise _unreadable(directory, e) from None


def _unreadable(directory: str, e: Exception) -> ValueError:
    return ValueError(
        f"checkpoint part {directory} is unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    )


def _spec(meta, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding)


def _laid_out(array: jax.Array, sharding) -> jax.Array:
    """`array` with `sharding` (a leaf read once for several buffers of one slice, e.g. a tied
    weight held by two of its stages, is moved only where their layouts differ)."""
    return array if array.sharding == sharding else jax.device_put(array, sharding)


class CheckpointStore:
    """The controller's side: which steps are committed, commit, prune, set damage aside.

    A step whose manifest.json exists but cannot be read (not JSON, not UTF-8, another step's,
    or other bytes than its digest in manifest.sha256 says) is damaged, not committed; a
    manifest without that file (written before digests were recorded) is read unverified. A
    damaged step is renamed to `<step>.damaged-<n>`: out of the
    way of pruning (which counts committed steps only) and of a new save of that step, and
    kept for a person to look at.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir) / "checkpoints"

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    def _steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(d.name) for d in self.root.iterdir() if d.name.isdigit() and d.is_dir())

    def committed(self) -> list[int]:
        """Steps with a readable manifest, oldest first."""
        return [s for s in self._steps() if self.manifest(s) is not None]

    def damaged(self) -> dict[int, str]:
        """{step: why} of steps whose manifest.json is there but unreadable."""
        out = {}
        for s in self._steps():
            why = self._read(s)[1]
            if why is not None:
                out[s] = why
        return out

    def quarantined(self) -> list[Path]:
        """Step directories set aside as damaged."""
        return sorted(self.root.glob("*.damaged-*")) if self.root.is_dir() else []

    def manifest(self, step: int) -> dict | None:
        return self._read(step)[0]

    def _read(self, step: int) -> tuple[dict | None, str | None]:
        """(manifest, None) if committed; (None, why) if its manifest is damaged; (None, None)
        if it has none (an interrupted save)."""
        path = self.step_dir(step) / MANIFEST
        try:
            raw = path.read_bytes()
            m = json.loads(raw.decode("utf-8"))
            expected = _read_digest(self.step_dir(step) / MANIFEST_DIGEST)
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 at all
            return None, f"{path} is unreadable: {type(e).__name__}: {str(e)[:120]}"
        if expected is not None and hashlib.sha256(raw).hexdigest() != expected:
            return None, f"{path} does not match its digest in {MANIFEST_DIGEST} (damaged)"
        if not isinstance(m, dict) or m.get("step") != step:
            return None, f"{path} is not the manifest of step {step}"
        return m, None

    def quarantine(self, step: int, why: str) -> Path:
        """Rename a damaged step aside to `<step>.damaged-<n>` (n: the first free number)."""
        n = 0
        while (aside := self.root / f"{step}.damaged-{n}").exists():
            n += 1
        os.replace(self.step_dir(step), aside)
        log.warning("checkpoint step %d is damaged (%s); moved aside to %s", step, why, aside)
        return aside

    def discard(self, step: int) -> None:
        """Remove what a failed save of `step` left (never a committed step)."""
        d = self.step_dir(step)
        if self.manifest(step) is None and d.exists():
            shutil.rmtree(d, ignore_errors=True)

    def prepare(self, step: int) -> Path:
        """The directory to save `step` into; clears what an interrupted save left there (a
        damaged step is moved aside instead). Refuses a committed step: committed data is
        never overwritten."""
        d = self.step_dir(step)
        manifest, damage = self._read(step)
        if manifest is not None:
            raise FileExistsError(f"checkpoint step {step} is already committed at {d}; it is never overwritten")
        if damage is not None:
            self.quarantine(step, damage)
        elif d.exists():
            log.warning("removing uncommitted checkpoint directory %s (an interrupted save)", d)
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def commit(self, step: int, manifest: dict) -> None:
        """Write `manifest` as step's manifest.json, its digest first (each atomically): a
        manifest is never there without the digest it is checked against."""
        d = self.step_dir(step)
        raw = json.dumps({**manifest, "step": step}, indent=1, sort_keys=True).encode("utf-8")
        _write_atomic(d / MANIFEST_DIGEST, hashlib.sha256(raw).hexdigest().encode())
        _write_atomic(d / MANIFEST, raw)

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` committed steps, and the newest good one (good: its loss was
        finite and its leaves digested) whatever came after it; drop older ones and stale
        uncommitted ones. A damaged step is neither counted nor dropped (restore moves it
        aside)."""
        committed = self.committed()
        if not committed:
            return
        keep_set = set(committed[-keep:]) if keep > 0 else set(committed)
        good = [s for s in committed if is_good(self.manifest(s))]
        keep_set |= set(good[-1:])
        damaged = self.damaged()
        newest = committed[-1]
        for s in self._steps():
            if s in keep_set or s in damaged:
                continue
            if s in committed or s < newest:
                shutil.rmtree(self.step_dir(s), ignore_errors=True)


def is_good(manifest: dict | None) -> bool:
    """Whether a committed step's manifest says its loss was finite and records its leaves'
    digests: a state worth keeping whatever came after it."""
    return bool(
        manifest
        and manifest.get("finite") is True
        and all("digest" in leaf for leaf in manifest.get("leaves", {}).values())
    )


def _read_digest(path: Path) -> str | None:
    """The hex digest in `path`, or None when there is none (a step saved before digests)."""
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return "(unreadable)"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
