"""What a run writes for its report beyond metrics and traces: <run_dir>/run.json.

    record.write_run_info(run_dir, pipeline, optimizer, schedule, micro_inputs, micro_targets,
                          config_file="configs/gpt_tiny.yaml", overrides=["train.steps=20"])

written once, when the run starts (a resumed run rewrites it), holds
- "versions": mpmd's, JAX's and the libraries' the run trained with, and Python's;
- "config_file", "file_values", "overrides": where the resolved config.yaml came from (the
  YAML file, its own values as they were when the run started, the key=value arguments), so
  the report can say which keys the command line changed and which are defaults;
- "memory": the dry run's prediction (mpmd.stages.costs.memory / slice_memory, from shapes
  alone): per stage and per slice, bytes of parameters, gradients, optimizer state and saved
  activations at the schedule's peak;
- "tokenizer": {spec, hash, vocab_size, eos_id} of what the run encodes text with, its file
  copied beside as tokenizer.json unless bytes (mpmd.recipes.data.tokenizer.run_tokenizer).
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Sequence

import yaml

RUN_INFO_FILE = "run.json"
# Distributions whose versions change what a run computes or how fast.
_DISTRIBUTIONS = (
    "mpmd",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "grpcio",
    "grain",
    "tokenizers",
)


def versions() -> dict[str, str]:
    """{distribution: version} of what is installed here, Python's included."""
    out = {"python": platform.python_version()}
    for name in _DISTRIBUTIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def predicted_memory(pipeline, optimizer, schedule, micro_inputs, micro_targets, layout=None) -> dict:
    """{"stages": per stage bytes, "slices": per slice bytes} as `mpmd train --dry-run` prints
    them (traced only: nothing is allocated); micro_inputs may be one microbatch's batch dict;
    `layout`: the run's mpmd.lowering.core.Layout (what fsdp holds whole is then counted)."""
    from mpmd.stages import batch as batches  # imports JAX: only the recipe's process needs it
    from mpmd.stages import costs
    from mpmd.stages.specs import spec

    if isinstance(micro_inputs, dict):  # one microbatch of a batch dict (micro_targets unused)
        feeds = batches.plan(pipeline, {k: spec(v) for k, v in micro_inputs.items()}, pair=False)
        micro = (None, None)
    else:
        feeds, micro = None, (spec(micro_inputs), spec(micro_targets))
    per_stage = costs.memory(
        pipeline,
        optimizer,
        *micro,
        feeds=feeds,
        layout=layout,
        placement=schedule.placement,
        split_backward=schedule.split_backward,
    )
    return {"stages": per_stage, "slices": costs.slice_memory(schedule, per_stage)}


def memory_meanwhile(pipeline, optimizer, schedule, micro: tuple, layout=None) -> concurrent.futures.Future:
    """predicted_memory(pipeline, optimizer, schedule, *micro, layout) traced on a thread (~0.7 s
    for gpt_tiny), as `mpmd train` does while the Trainer starts its workers, which it mostly
    waits for; the future's result is the prediction."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpmd-memory")
    try:
        return pool.submit(predicted_memory, pipeline, optimizer, schedule, *micro, layout)
    finally:
        pool.shutdown(wait=False)


def write_run_info(
    run_dir: str | Path,
    pipeline,
    optimizer,
    schedule,
    micro_inputs,
    micro_targets,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    tokenizer: dict | None = None,
    layout=None,
    memory: dict | None = None,
) -> Path:
    """Writes <run_dir>/run.json (see the module doc); returns its path. `tokenizer`: what
    the run encodes text with (mpmd.recipes.data.tokenizer.run_tokenizer reads it back).
    `memory`: predicted_memory's result where the caller has it already (else traced here)."""
    file_values = {}
    if config_file is not None and Path(config_file).is_file():
        file_values = yaml.safe_load(Path(config_file).read_text()) or {}
    info = {
        "versions": versions(),
        "config_file": config_file,
        "file_values": file_values,
        "overrides": list(overrides),
        **({"tokenizer": tokenizer} if tokenizer else {}),
        "memory": memory or predicted_memory(pipeline, optimizer, schedule, micro_inputs, micro_targets, layout),
    }
    path = Path(run_dir) / RUN_INFO_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(path)
    return path


def read_run_info(run_dir: str | Path) -> dict:
    """run.json's contents; {} for a run that has none (started before run.json existed)."""
    path = Path(run_dir) / RUN_INFO_FILE
    return json.loads(path.read_text()) if path.exists() else {}
