"""`mpmd train CONFIG --dry-run`: what a run would need, from shapes alone, before any worker.

    summary = plan.dry_run(config.load("configs/llama_1b.yaml"))
    print(plan.describe(summary))

The model is built abstract where its family can be (mpmd.abstract: shapes, no arrays; a
tied Llama, cut at marks, is built for real), split and laid out as `mpmd train` would; then
- the parameter count (and, for a mixture of experts, the parameters active per token);
- per slice, bytes of parameters, accumulated gradients, optimizer state and saved
  activations at the schedule's peak (mpmd.stages.costs.slice_memory: the residuals each
  stage's forward keeps per microbatch, so `model.remat` shows here), and with
  mesh.fsdp_gather=per_step the weights gathered over fsdp for the step; gradients a stage
  accumulates unreduced until reduce{k} count whole per fsdp device (mpmd.stages.costs.memory);
- the simulator's predicted step: each stage's programs are exported as the Trainer ships
  them and priced by XLA's cost analysis (mpmd.stages.costs.measure; remat's recomputation
  shows in the backward costs), the schedule is simulated with those costs, and the critical
  path is converted to seconds at an assumed sustained rate per slice (`tflops`).
"""

from __future__ import annotations

import numpy as np

import mpmd
from mpmd.lowering import dryrun
from mpmd.stages import costs as stage_costs
from mpmd.schedules.simulate import simulate
from mpmd.stages.specs import spec
from mpmd.recipes.data import loaders as data
from mpmd.recipes import registry
from mpmd.recipes.config import Config, ConfigError
from mpmd.recipes.run.build import build_model, build_optimizer, check_layout


def dry_run(cfg: Config, tflops: float = 400.0) -> dict:
    """Parameter count, per-slice memory and the predicted step of cfg's run (see module doc).
    `tflops`: sustained TFLOP/s of one slice the predicted seconds assume."""
    if not tflops > 0:
        raise ValueError(f"tflops must be a positive number, got {tflops!r}")
    p = cfg.pipeline
    if registry.get_data_source(cfg.data.source).masks_loss(cfg):  # batch dicts with a loss_mask
        raise ConfigError(
            f"--dry-run does not yet size a run whose batches carry a loss mask (data.source='{cfg.data.source}'"
            + (", data.pack=true" if getattr(cfg.data, "pack", False) else "")
            + "); size it with data.source=synthetic train.exact_match=0 (the same shapes and parameters)"
        )
    train_loader, _ = data.make_loaders(cfg)
    inputs, targets = train_loader.batch_at(0)
    micro = len(inputs) // p.num_microbatches
    in_spec, tgt_spec = spec(inputs[:micro]), spec(targets[:micro])
    # Abstract where the family can be (its spec says; a tied Llama is built for real).
    stages, loss_fn = build_model(cfg, inputs[:micro], abstract=True)
    pipeline = mpmd.Pipeline(stages, loss_fn)
    optimizer = build_optimizer(cfg)
    run = check_layout(cfg, pipeline, optimizer)
    schedule = run.schedule
    per_stage = stage_costs.memory(
        pipeline,
        optimizer,
        in_spec,
        tgt_spec,
        layout=run.layout,
        placement=run.placement,
        split_backward=schedule.split_backward,
    )
    costs = stage_costs.measure(pipeline, in_spec, tgt_spec)
    simulation = simulate(schedule, dryrun.executed_costs(schedule, costs))
    # Shared weights (a tied embedding) sit in several stages but are one parameter.
    shared = {(k, i) for group in pipeline.shared for k, i in group[1:]}
    num_params = sum(
        int(np.prod(leaf.shape))
        for k, fn in enumerate(pipeline.fns)
        for i, leaf in enumerate(fn.param_leaves)
        if (k, i) not in shared
    )
    sizes = {
        path: int(np.prod(leaf.shape))
        for paths, fn in zip(getattr(stages, "param_paths", ()), pipeline.fns)
        for path, leaf in zip(paths, fn.param_leaves)
    }
    active = registry.get_model_spec(cfg.model.kind).active_params(cfg, sizes)
    return {
        "num_params": num_params,
        "active_params": active,
        "num_stages": pipeline.num_stages,
        "schedule": schedule.name,
        "num_microbatches": p.num_microbatches,
        "microbatch": list(in_spec.shape),
        # A family without these keys computes in float32 and keeps every residual.
        "dtype": getattr(cfg.model, "dtype", "float32"),
        "remat": getattr(cfg.model, "remat", "none"),
        "stages": per_stage,
        "slices": stage_costs.slice_memory(schedule, per_stage),
        "step_flops": simulation.makespan,
        "bubble": simulation.bubble_fraction,
        "tflops": tflops,
        "step_s": simulation.makespan / (tflops * 1e12),
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def describe(summary: dict) -> str:
    s = summary
    count = f"{s['num_params'] / 1e9:.3f} B" if s["num_params"] >= 1e9 else f"{s['num_params'] / 1e6:.3f} M"
    active = s.get("active_params")
    if active is not None:  # a mixture of experts: what one token computes with
        count += (
            f"; active per token {active:,} ({active / 1e9:.3f} B)"
            if active >= 1e9
            else f"; active per token {active:,} ({active / 1e6:.3f} M)"
        )
    lines = [
        f"parameters: {s['num_params']:,} ({count}), "
        f"{s['num_stages']} stages, {s['schedule']}, {s['num_microbatches']} microbatches of "
        f"{s['microbatch']}, dtype {s['dtype']}, remat {s['remat']}"
    ]
    for k, m in enumerate(s["stages"]):
        lines.append(
            f"  stage {k}: params {_gib(m['params'])}, saved activations {_gib(m['residuals'])} per microbatch"
        )
    for r, m in enumerate(s["slices"]):
        gathered = f" + gathered weights {_gib(m['gathered'])}" if m.get("gathered") else ""
        lines.append(
            f"slice {r}: {_gib(m['total'])} = params {_gib(m['params'])} + grads "
            f"{_gib(m['grads'])} + optimizer {_gib(m['optimizer'])} + saved activations "
            f"{_gib(m['activations'])} (peak){gathered}"
        )
    flops = f"{s['step_flops'] / 1e12:.1f} TFLOP" if s["step_flops"] >= 1e12 else f"{s['step_flops'] / 1e9:.3g} GFLOP"
    lines.append(
        f"predicted step: {flops} on the critical path, "
        f"{s['step_s']:.3g} s at {s['tflops']:g} TFLOP/s sustained per slice; "
        f"bubble {s['bubble']:.1%}"
    )
    lines.append(
        "not counted: activations in transit, XLA temporaries; a slice's figures are over "
        "all its devices (sharded parameters divide among them)"
    )
    return "\n".join(lines)
