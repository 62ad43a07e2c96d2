"""What `mpmd train` no longer does again at a run's start and end, each beside the way it did
it before, in alternating rounds of one run (issue 56, item 2):

    .venv/bin/python benchmarks/bench_run_start.py [--config configs/gpt_tiny.yaml] [--rounds 5]

- sample: the end-of-run sample's model. Before: built again from the config (model_with
  without a template); now: made from the run's own model (generate.template_of), nothing
  built or traced.
- start: the run record's predicted memory (mpmd.report.record.predicted_memory). Before:
  traced after the Trainer started its workers; now: traced on a thread while it starts them
  (mpmd.report.record.memory_meanwhile). Timed from before the Trainer's construction to
  the prediction in hand, on 2 LocalCluster workers.
- dry run: `mpmd train --dry-run`'s program prices (mpmd.stages.costs.measure). Before: every
  program of both backward forms exported (7 a stage); now the 4 priced.
- split: the per-layer FLOPs mpmd.split balances stages by (mpmd.stages.costs.layer_costs), on
  the model built abstractly. Before: every layer lowered; now: a layer with the graphdef,
  parameters and input of one priced before (a repeated block) is not lowered again.

`--parts split --config configs/llama_1b.yaml` times the split alone (the other parts start
or trace the whole model).

Medians over the rounds, spread in brackets, and now / before.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

import mpmd
from mpmd.recipes import config
from mpmd.recipes.data import loaders as data
from mpmd.recipes.run import build, generate
from mpmd.recipes.run import train as train_run
from mpmd.report import record as report_record
from mpmd.stages import costs, names
from mpmd.stages import programs as stage_programs
from mpmd.stages.leaf_paths import path_string
from mpmd.stages.pipeline import stage_fn
from mpmd.stages.specs import spec


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def sample_parts(cfg):
    built, _ = build.built_model(cfg, abstract=False)
    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(built, nnx.Param))
    params = {path_string(kp): np.asarray(leaf) for kp, leaf in flat}
    template = generate.template_of(built)
    return {
        "before": lambda: generate.model_with(cfg, params),
        "now": lambda: generate.model_with(cfg, params, template),
    }


def start_parts(cfg):
    train_loader, _ = data.make_loaders(cfg)
    sample = train_run._first_microbatch(train_loader, cfg.pipeline.num_microbatches)
    stages, loss_fn = build.build_model(cfg, sample)
    pipeline = mpmd.Pipeline(stages, loss_fn, sample_input=sample)
    optimizer = build.build_optimizer(cfg)
    layout = build.check_layout(cfg, pipeline, optimizer)
    micro = train_run._first_micro(train_loader, len(sample))

    def trainer():
        return mpmd.Trainer(pipeline, optimizer, layout=layout, cluster=mpmd.LocalCluster())

    def before():
        t = trainer()
        try:
            report_record.predicted_memory(pipeline, optimizer, layout.schedule, *micro, layout.layout)
        finally:
            t.close()

    def now():
        memory = report_record.memory_meanwhile(pipeline, optimizer, layout.schedule, micro, layout.layout)
        t = trainer()
        try:
            memory.result()
        finally:
            t.close()

    return {"before": before, "now": now}


def dry_run_parts(cfg):
    train_loader, _ = data.make_loaders(cfg)
    inputs, targets = train_loader.batch_at(0)
    micro = len(inputs) // cfg.pipeline.num_microbatches
    stages, loss_fn = build.build_model(cfg, inputs[:micro], abstract=True)
    pipe = mpmd.Pipeline(stages, loss_fn)
    x, y = spec(inputs[:micro]), spec(targets[:micro])

    def before():  # every program of both forms, as measure exported them until 2026-12-07
        for k, fn, shapes, first, last, loss, _ in costs._stage_shapes(pipe, x, y):
            built = {}
            for split in (True, False):
                built.update(
                    stage_programs.build(
                        k, fn, shapes, first=first, last=last, loss_fn=loss, num_microbatches=1, split_backward=split
                    )
                )
            for kind in ("fwd", "bwd_w_first", "bwd_first") + (() if first else ("bwd_in",)):
                costs.program_cost(built[names.program(kind, k)])

    return {"before": before, "now": lambda: costs.measure(pipe, x, y)}


def split_parts(cfg):
    train_loader, _ = data.make_loaders(cfg)
    inputs, _ = train_loader.batch_at(0)
    sample = inputs[: len(inputs) // cfg.pipeline.num_microbatches]
    model, _ = build.built_model(cfg, abstract=True)
    layers = list(getattr(model, "all_layers", model.layers)())  # a tied Llama's too
    return {
        "before": lambda: costs.fn_costs([stage_fn(l) for l in layers], sample),
        "now": lambda: costs.layer_costs(layers, sample),
    }


PARTS = {"sample": sample_parts, "start": start_parts, "dry run": dry_run_parts, "split": split_parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/gpt_tiny.yaml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = ap.parse_args()
    cfg = config.load(args.config, ["train.steps=1"])
    chosen = args.parts.split(",")
    if unknown := set(chosen) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(unknown)}; allowed: {', '.join(PARTS)}")
    parts = {name: PARTS[name](cfg) for name in chosen}
    for pair in parts.values():  # warm: JAX's caches, the workers' compilation cache
        for fn in pair.values():
            fn()
    times = {(name, which): [] for name in parts for which in ("before", "now")}
    for r in range(args.rounds):
        for name, pair in parts.items():
            order = ("before", "now") if r % 2 == 0 else ("now", "before")
            for which in order:
                times[name, which].append(timed(pair[which]))
    print(f"{args.config}, {args.rounds} rounds, medians (spread), seconds")
    for name in parts:
        b, n = times[name, "before"], times[name, "now"]
        print(
            f"{name:8s} before {statistics.median(b):.3f} ({min(b):.3f}-{max(b):.3f})  "
            f"now {statistics.median(n):.3f} ({min(n):.3f}-{max(n):.3f})  "
            f"now/before {statistics.median(n) / statistics.median(b):.2f}x"
        )


if __name__ == "__main__":
    main()
