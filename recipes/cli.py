"""The `mpmd` command: `mpmd train`, `mpmd generate`, `mpmd tune`, `mpmd plan`, `mpmd tokenizer`, `mpmd tokenize`, `mpmd sft-data`, `mpmd export`, `mpmd worker`, `mpmd schedule`, `mpmd report`, `mpmd cluster`. Logic lives in modules."""

from __future__ import annotations

import os
import sys

COMMANDS = {
    "train": ("mpmd.recipes.commands.train", "train a model from a YAML config and key=value overrides"),
    "generate": ("mpmd.recipes.commands.generate", "continue a prompt with a trained run's model (key-value cache)"),
    "tune": (
        "mpmd.recipes.commands.tune",
        "pick the split, schedule, microbatches and virtual stages from measured costs",
    ),
    "plan": (
        "mpmd.recipes.commands.plan",
        "goodput under failures and the checkpoint intervals that maximise it: mpmd plan goodput CONFIG",
    ),
    "tokenizer": (
        "mpmd.recipes.commands.tokenizer",
        "make a byte-level BPE tokenizer from your text files: mpmd tokenizer train",
    ),
    "tokenize": ("mpmd.recipes.commands.tokenize", "tokenize text files into a corpus data.source=tokens trains from"),
    "sft-data": (
        "mpmd.recipes.commands.sft_data",
        "write a generated fine-tuning data set (jsonl) data.source=jsonl trains on",
    ),
    "schedule": ("mpmd.schedules.cli", "simulate a pipeline schedule and draw its timeline"),
    "report": ("mpmd.report.cli", "one HTML page of a run: curves, measured vs simulated pipeline, goodput, memory"),
    "export": (
        "mpmd.recipes.commands.export",
        "write a run's checkpoint as a Hugging Face Llama: mpmd export RUN_DIR --hf OUT_DIR",
    ),
    "cluster": (
        "mpmd.recipes.commands.cluster",
        "a persistent cluster several jobs share: mpmd cluster up|status|down",
    ),
    "worker": ("mpmd.runtime.worker.main", "serve one slice: mpmd worker --listen HOST:PORT --token-file F"),
}


def version() -> str:
    """'mpmd X (jax Y, jaxlib Z, Python P)': what a bug report needs first."""
    import platform
    from importlib import metadata

    def of(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"mpmd {of('mpmd')} (jax {of('jax')}, jaxlib {of('jaxlib')}, Python {platform.python_version()})"


# Commands whose own process compiles (the model's initialisation, the stages' lowering, the
# decoder): they use JAX's persistent compilation cache, as the workers do.
COMPILING = ("train", "generate", "tune", "export")


def use_compilation_cache() -> None:
    """JAX's persistent compilation cache for this process, before JAX is imported: the
    directory the workers use (runtime/launchers/workers.py default_compilation_cache:
    $JAX_COMPILATION_CACHE_DIR, else ~/.cache/mpmd/jax), every program cached however fast it
    compiled (a run's many small ones are what a restart pays for). A JAX_COMPILATION_CACHE_DIR
    set in the environment is kept as it is ("" switches the cache off)."""
    from mpmd.runtime.launchers.workers import default_compilation_cache

    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = default_compilation_cache()
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(version())
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:10s} {doc}" for name, (_, doc) in COMMANDS.items()]
        msg = (
            "usage: mpmd COMMAND [ARGS]    (mpmd COMMAND --help: its arguments; mpmd --version)\n\ncommands:\n"
            + "\n".join(lines)
        )
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command {argv[0]!r}; allowed: {', '.join(COMMANDS)}\n\n{msg}", file=sys.stderr)
            return 2
        print(msg)
        return 0
    import faulthandler
    import importlib
    import signal

    # `kill -USR1 <pid>` prints every thread's stack on stderr and goes on (as a worker does):
    # how to see where a controller that seems hung is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if argv[0] in COMPILING:
        use_compilation_cache()
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
