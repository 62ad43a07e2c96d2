"""`mpmd tune CONFIG [key=value ...]`: pick pipeline.num_stages, cuts, schedule,
num_microbatches and virtual_stages for a config from costs measured on its cluster
(mpmd.tune: profile, search, confirm), print the confirmed candidates' predicted against
measured step and peak memory, and write the winner as a config `mpmd train` takes as is:
the input config (file and overrides) with the chosen pipeline keys (tune.output, default
tuned.yaml).

The number of workers stays the config's (pipeline.num_stages // pipeline.virtual_stages,
or cluster.num_workers); the search varies how many stages each holds. The batch is the
config's first training batch. Exit status: 0 done, 2 bad config (nothing started, nothing
written), 1 no candidate fits the memory cap.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from mpmd.recipes import config
from mpmd.recipes.commands.arguments import config_arguments, section_keys
from mpmd.recipes.run import console
from mpmd.recipes import registry
from mpmd.recipes.files import publish


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd tune",
        description="Choose the pipeline split, schedule, microbatches and virtual stages from costs\n"
        "measured on the config's own cluster; print the confirmed candidates (predicted against\n"
        "measured step and memory) and write the winner as a config mpmd train takes as is: the\n"
        "input config with the chosen pipeline.* keys, to tune.output (never overwritten).",
        epilog=f"{section_keys('tune', config.TuneConfig)}\n\nexample:\n"
        "  mpmd tune configs/gpt_small.yaml tune.memory_gb=2 tune.confirm=3 tune.output=small_tuned.yaml\n"
        "  mpmd train small_tuned.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config_arguments(parser)
    return parser


def default_memory_gb(num_slices: int) -> float:
    """The device's memory: a CPU worker's device is this host's memory, shared by the
    local workers, so each slice gets its share."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / num_slices


def tuned_values(values: dict, keys: dict) -> dict:
    """`values` (the input config's overrides) with the chosen dotted `keys` set."""
    out = yaml.safe_load(yaml.safe_dump(values))  # a deep copy of plain data
    for dotted, value in keys.items():
        *sections, leaf = dotted.split(".")
        node = out
        for section in sections:
            if not isinstance(node.get(section), dict):
                node[section] = {}
            node = node[section]
        node[leaf] = value
    return out


def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
    try:
        values = config.values_of(args.config, args.overrides)
        cfg = config.validate(values)
        console.to_console(console.level(cfg.log.level))
        output = Path(cfg.tune.output)
        if output.exists():
            raise config.ConfigError(
                f"tune.output={cfg.tune.output!r} exists; move it away or set "
                f"tune.output to a new file (a tuned config is never overwritten)"
            )
        if not registry.get_backend_spec(cfg.cluster.backend).worker_processes:
            workers = [name for name, spec in registry.backend_specs().items() if spec.worker_processes]
            raise config.ConfigError(
                f"mpmd tune measures on worker processes: cluster.backend must be "
                f"{registry.one_of(workers)}, got '{cfg.cluster.backend}'"
            )
    except config.ConfigError as e:
        console.error(e)
        return 2
    from mpmd.tuner.search import NoCandidateFits
    from mpmd.recipes.run import build  # imports JAX: only once the config is known to be good

    try:
        result = run(cfg, build)
    except config.ConfigError as e:
        console.error(e)
        return 2
    except NoCandidateFits as e:
        console.error(f"tune.memory_gb: {e}")
        return 1
    best = result.best
    print(result.table())
    print(
        f"search: {len(result.ranked)} candidates ranked, {len(result.excluded)} over the memory cap, "
        f"{result.search_s:.2f} s"
    )
    tuned = tuned_values(values, best.keys())
    config.validate(tuned)  # what mpmd train will load
    header = (
        f"# mpmd tune {args.config} {' '.join(args.overrides)}\n# winner: {best.label}, predicted "
        f"{best.predicted_step_s * 1e3:.1f} ms per step\n"
    )
    publish(output, header + yaml.safe_dump(tuned, sort_keys=False))  # a config already there: whole or new
    print(f"wrote {output}: mpmd train {output}")
    return 0


def run(cfg: config.Config, build):
    """Profile, search and confirm cfg's model on cfg's cluster (mpmd.tune)."""
    import mpmd
    from mpmd.recipes.data import loaders as data

    t = cfg.tune
    num_slices = cfg.num_slices
    loader, _ = data.make_loaders(cfg)
    inputs, targets = loader.batch_at(0)
    units, loss_fn = build.model_units(cfg)
    if num_slices > len(units):
        raise config.ConfigError(
            f"{num_slices} workers need at least as many layers to hold, the model has "
            f"{len(units)}; lower pipeline.num_stages"
        )
    memory_gb = t.memory_gb if t.memory_gb is not None else default_memory_gb(num_slices)
    cluster = build.build_cluster(cfg)
    try:
        return mpmd.tune(
            units,
            loss_fn,
            build.build_optimizer(cfg),
            inputs,
            targets,
            cluster,
            num_slices,
            memory_gb=memory_gb,
            confirm=t.confirm,
            confirm_steps=t.confirm_steps,
            microbatch_counts=t.microbatch_counts,
            schedule_names=t.schedule_names,
            max_virtual_stages=t.max_virtual_stages,
            max_grad_norm=cfg.optimizer.max_grad_norm,
        )
    finally:
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
