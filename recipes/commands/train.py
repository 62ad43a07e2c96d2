"""`mpmd train CONFIG [key=value ...] [--dry-run] [--help-config]`: one training run from a
YAML config (or, with --dry-run, its size, memory and predicted step: recipes/run/plan.py).

`main(argv)` takes the arguments after the word `train` and returns the exit status: 0 when
the run finished (or its plan was printed), 2 when the config is invalid (message
"error: ..." on stderr), 1 when the run stopped on its checkpoints, its disk or a failed
step (unrestorable checkpoints, saves that keep failing, a full or read-only disk, a slice
that failed at an instruction, which a replay would fail alike: one line "error: ...").
The config is loaded and checked before JAX is imported, so a bad one fails in well under
a second and leaves nothing behind (no run directory, no workers).
"""

from __future__ import annotations

import argparse
import os
import sys

from mpmd.recipes import config
from mpmd.recipes.run import console
from mpmd.recipes.commands.arguments import positive


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd train",
        description="Train a model with MPMD pipeline parallelism from a YAML config.",
        epilog="example: mpmd train configs/gpt_tiny.yaml train.steps=50 cluster.backend=inprocess",
    )
    parser.add_argument(
        "config", metavar="CONFIG", nargs="?", help="YAML file of overrides of the defaults (see --help-config)"
    )
    parser.add_argument(
        "overrides",
        metavar="key=value",
        nargs="*",
        help="dotted-key overrides of the file, values parsed as YAML "
        "(train.steps=100, log.trace_steps=[1,2], optimizer.max_grad_norm=null)",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a run directory although keys that change training "
        "(model, optimizer, data, seed, batch sizes) differ; both config "
        "hashes are recorded",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="build the model abstractly (no arrays) and print its parameter count, "
        "per-slice memory and the simulator's predicted step; start nothing",
    )
    parser.add_argument(
        "--tflops",
        type=positive(float),
        default=400.0,
        metavar="T",
        help="with --dry-run: sustained TFLOP/s per slice the predicted step time assumes (default 400)",
    )
    parser.add_argument(
        "--help-config", action="store_true", help="print every config key with its default and description, and exit"
    )
    return parser


def _ensure_host_devices(num_devices: int) -> None:
    """InProcessCluster gives each slice its own JAX devices (as many as its mesh), and JAX on
    CPU shows one device unless XLA_FLAGS asks for more before JAX starts; ask, unless the
    user already chose."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags or "jax" in sys.modules:
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()


def main(argv=None) -> int:
    # intermixed: `mpmd train C --dry-run key=value` takes the override after the flag too
    args = parser().parse_intermixed_args(argv)
    if args.help_config:
        print(config.describe())
        return 0
    if args.config is None:
        console.error("missing CONFIG (a YAML file; run with --help-config for every key)")
        return 2
    try:
        cfg = config.load(args.config, args.overrides)
        console.to_console(console.level(cfg.log.level))
    except config.ConfigError as e:
        console.error(e)
        return 2
    if args.dry_run:
        from mpmd.recipes.run import plan  # imports JAX

        try:
            print(plan.describe(plan.dry_run(cfg, args.tflops)))
        except config.ConfigError as e:
            console.error(e)
            return 2
        return 0
    from mpmd.recipes import registry

    if registry.get_backend_spec(cfg.cluster.backend).in_process_devices:
        _ensure_host_devices(cfg.num_devices)
    from mpmd.recipes.run import train  # imports JAX: only once the config is known to be good
    from mpmd.runtime.wire.results import StepFailed
    from mpmd.runtime.control.cluster import ClusterGone, ClusterUnavailable
    from mpmd.runtime.compat import VersionMismatch
    from mpmd.recipes.run import preempt

    try:
        if cfg.rl.algorithm is not None:  # reinforcement learning: a loop of its own
            from mpmd.recipes.run import rl

            summary = rl.run(cfg, source=(args.config, args.overrides))
        else:
            summary = train.run(cfg, allow_config_change=args.allow_config_change, source=(args.config, args.overrides))
    except preempt.Preempted as e:
        from mpmd.runtime.worker.slice_store import CheckpointStore

        committed = CheckpointStore(cfg.run_dir).committed()
        kept = f"step {committed[-1]}" if committed else "none (the run starts over)"
        print(
            f"stopped by SIGTERM: {e}; kept the last committed checkpoint, {kept}; resume with the same "
            f"command (exit code {preempt.PREEMPTED_EXIT})",
            flush=True,
        )
        return preempt.PREEMPTED_EXIT
    # Found while building (custom module, stage count, ...) or starting (a worker on another JAX).
    except (config.ConfigError, VersionMismatch) as e:
        console.error(e)
        return 2
    except (train.CheckpointError, train.NonFinite) as e:
        console.error(e)
        return 1
    except (ClusterGone, ClusterUnavailable) as e:
        console.error(e)
        return 1
    except StepFailed as e:  # the worker's log has its traceback; XLA's messages may span lines
        console.error(" ".join(str(e).split()))
        return 1
    except OSError as e:  # the run's own files: ENOSPC, EROFS, EACCES, ...
        where = f": {e.filename}" if e.filename else ""
        console.error(f"{e.strerror or e}{where}; the run stopped after its last committed checkpoint")
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return preempt.PREEMPTED_EXIT if summary["preempted"] else 0


if __name__ == "__main__":
    sys.exit(main())
