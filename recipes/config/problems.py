"""What is wrong across the sections of a config (each problem a full sentence naming the
keys), run by Config's validator once every section is valid on its own. A key a family or
backend does not take is not here: its section has no such key (loading.py says which
kinds or backends take it); what a family or backend needs of the other sections is its
spec's `problems`, and a schedule's rules are mpmd.schedules', found by building it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from mpmd.recipes import registry
from mpmd.recipes.config import rl
from mpmd.runtime.worker.mesh import devices_problem
from mpmd.schedules import core as schedules
from mpmd.stages.mesh_axes import rule_problem

if TYPE_CHECKING:
    from mpmd.recipes.config.schema import Config, PipelineConfig

_ADDRESS = re.compile(r"^[^\s:]+:(\d{1,5})$")


def address_problem(where: str, address: str, whose: str = "") -> str | None:
    """None for a 'host:port' with port 1..65535, else the sentence saying so."""
    match = _ADDRESS.match(address)
    if match and 0 < int(match.group(1)) < 65536:
        return None
    return f"{where} {address!r} must be {whose}'host:port' with port 1..65535"


def _schedule_problem(p: PipelineConfig) -> str | None:
    """What mpmd.schedules says is wrong with the pipeline section (which schedules take
    virtual stages, how many microbatches each needs), found by building the schedule: the
    rules live there only. Its messages name make()'s parameters, which are this section's
    keys, so prefixing them makes the message name the config key."""
    try:
        schedules.make(p.schedule, p.num_stages, p.num_microbatches, p.virtual_stages)
    except ValueError as e:
        text = str(e).replace("schedule '", "pipeline.schedule='")
        return re.sub(r"(?<![.\w])(num_stages|num_microbatches|virtual_stages)\b", r"pipeline.\1", text)
    return None


def cross_field_problems(c: Config) -> list[str]:
    """Every cross-section inconsistency, each a full sentence; empty when the config is sound."""
    p, t, d, tb = c.pipeline, c.train, c.data, c.tune
    out = []
    if t.batch_size % p.num_microbatches:
        out.append(
            f"train.batch_size={t.batch_size} must be divisible by "
            f"pipeline.num_microbatches={p.num_microbatches} (equal-sized microbatches)"
        )
    problem = _schedule_problem(p)
    if problem:
        out.append(problem)
    if p.cuts is not None and (
        len(p.cuts) != p.num_stages - 1 or p.cuts != sorted(set(p.cuts)) or (p.cuts and p.cuts[0] < 1)
    ):
        out.append(
            f"pipeline.cuts={p.cuts} must be {p.num_stages - 1} increasing layer indices >= 1 "
            f"(one per stage after the first, pipeline.num_stages={p.num_stages}), or null"
        )
    if tb.microbatch_counts is not None:
        bad = [m for m in tb.microbatch_counts if t.batch_size % m]
        if bad or not tb.microbatch_counts:
            out.append(
                f"tune.microbatch_counts={tb.microbatch_counts} must be a non-empty list of divisors "
                f"of train.batch_size={t.batch_size} "
                f"({[m for m in range(1, t.batch_size + 1) if t.batch_size % m == 0]}), or null"
            )
    if tb.schedule_names is not None and not tb.schedule_names:
        out.append(f"tune.schedule_names must name at least one of {list(schedules.SCHEDULES)}, or be null (all)")
    out += registry.get_model_spec(c.model.kind).problems(c)
    source = registry.get_data_source(d.source)
    try:
        registry.data_kind(c)
    except ValueError as e:
        out.append(str(e))
    out += source.problems(c)
    if t.exact_match and not source.held_out_examples:
        holders = [name for name, s in registry.data_sources().items() if s.held_out_examples]
        out.append(
            f"train.exact_match={t.exact_match} scores held-out prompt/response examples: it needs "
            f"data.source={registry.one_of(holders)}, got '{d.source}' (or set train.exact_match=0)"
        )
    if d.tokenizer != "bytes" and not hasattr(c.model, "vocab_size"):
        out.append(
            f"data.tokenizer={d.tokenizer!r} gives tokens, which model.kind='{c.model.kind}' does not read "
            f"(it has no model.vocab_size)"
        )
    if t.sample_tokens and not t.sample_prompt:
        out.append("train.sample_prompt must be non-empty when train.sample_tokens > 0")
    if c.optimizer.name != "adamw" and c.optimizer.weight_decay:
        out.append(
            f"optimizer.weight_decay={c.optimizer.weight_decay} only applies to 'adamw'; "
            f"set it to 0 for '{c.optimizer.name}'"
        )
    num_slices = max(1, p.num_stages // p.virtual_stages)
    if c.cluster.num_workers is not None and c.cluster.num_workers != max(1, c.num_workers):
        rl_on = c.rl.algorithm is not None
        sampler = " + 1 (rl.algorithm's sampler)" if rl_on else ""
        sampler += " + 1 (rl.kl_coef's reference)" if rl_on and c.rl.kl_coef > 0 else ""
        out.append(
            f"cluster.num_workers={c.cluster.num_workers} must equal pipeline.num_stages // "
            f"pipeline.virtual_stages{sampler} = {max(1, c.num_workers)} (or be null)"
        )
    out += rl.problems(c)
    out += registry.get_backend_spec(c.cluster.backend).problems(c)
    return out + _mesh_problems(c, num_slices)


def _mesh_problems(c: Config, num_slices: int) -> list[str]:
    """mesh.* against the slices and their devices. The rules are checked as
    mpmd.stages.sharding.check_rules checks them (mpmd.stages.mesh_axes), the devices by the
    rule the Trainer's sharding.slice_meshes and a worker's mesh.bind apply too
    (mpmd.runtime.worker.mesh.devices_problem), here before JAX is imported."""
    mesh, cl = c.mesh, c.cluster
    devices = cl.devices_per_worker * cl.processes_per_slice
    has = (
        f"cluster.devices_per_worker={devices}"
        if cl.processes_per_slice == 1
        else f"a slice has {devices} (cluster.devices_per_worker={cl.devices_per_worker} x "
        f"cluster.processes_per_slice={cl.processes_per_slice})"
    )
    out = []
    if mesh.stages is not None and len(mesh.stages) != num_slices:
        out.append(
            f"mesh.stages lists {len(mesh.stages)} slice shape(s) but there are {num_slices} slices "
            f"(pipeline.num_stages // pipeline.virtual_stages): give one per slice, or none"
        )
    # A worker owns devices_per_worker devices; an in-process slice takes as many as its mesh.
    elif not registry.get_backend_spec(cl.backend).in_process_devices:
        named = [(f"mesh.stages[{r}]", s) for r, s in enumerate(mesh.stages)] if mesh.stages else [("mesh", mesh)]
        out += [
            f"{where}: {p}" for where, shape in named if (p := devices_problem(shape.resolved(devices), devices, has))
        ]
    out += [p for name, target in mesh.rules.items() if (p := rule_problem(name, target, f"mesh.rules.{name}"))]
    return out
