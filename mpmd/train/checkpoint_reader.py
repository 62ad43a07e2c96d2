"""A finished run's checkpoint read in this process, by leaf path: for the tools that look at
one (`mpmd generate`, `mpmd export`, `model.init_from: run:`, tests), never on the training
path, where each slice restores its own part (mpmd/train/checkpoints.py)."""

from __future__ import annotations

import os

from mpmd.runtime.worker.slice_store import CheckpointStore
from mpmd.train.checkpoints import FORMAT


def committed_step(run_dir, step: int | None = None) -> int:
    """Committed `step` of run_dir's checkpoints (None: the newest). ValueError in one line when
    there is none, or `step` is not committed (naming those that are): the one message the
    readers of a finished run (`mpmd generate`, `mpmd export`, `model.init_from: run:`) give."""
    committed = CheckpointStore(os.path.abspath(run_dir)).committed()
    if not committed:
        raise ValueError(
            f"{str(run_dir)!r} has no committed checkpoint (checkpoints/<step> with a manifest.json): train it first"
        )
    if step is None:
        return committed[-1]
    if step not in committed:
        raise ValueError(
            f"step {step} is not a committed checkpoint of {str(run_dir)!r}; committed: "
            f"{', '.join(map(str, committed))}"
        )
    return step


def read_leaves(run_dir, step: int | None = None, prefix: str = "") -> tuple[int, dict]:
    """(step, {leaf name: host array}) of committed `step` (default the newest), read here,
    in this process, from every slice's directory: for looking at a checkpoint (tests, tools
    such as `mpmd export`), never on the training path. `prefix`: only the leaves whose names
    start with it (e.g. "params/")."""
    import jax
    import numpy as np
    from mpmd.runtime.worker.slice_store import SliceCheckpointer

    store = CheckpointStore(os.path.abspath(run_dir))
    step = store.committed()[-1] if step is None else step
    manifest = store.manifest(step)
    if manifest is None or manifest.get("format") != FORMAT:
        raise ValueError(f"step {step} in {store.root} is not a committed checkpoint of format {FORMAT}")
    items: dict[str, dict] = {}
    for name, leaf in manifest["leaves"].items():
        if name.startswith(prefix):
            items.setdefault(str(store.step_dir(step) / leaf["part"]), {})[name] = [(name, 0)]
    here = jax.sharding.make_single_device_sharding(jax.devices()[0])
    digests = {name: leaf["digest"] for name, leaf in manifest["leaves"].items() if "digest" in leaf}
    got = SliceCheckpointer().restore(items, lambda name, i: here, digests)
    return step, {name: np.asarray(arrays[0]) for name, arrays in got.items()}
