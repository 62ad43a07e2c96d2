"""`mpmd export RUN_DIR --hf OUT_DIR [--step N]`: a run's committed checkpoint as a Hugging Face
Llama directory (config.json + model.safetensors, float32; the run's tokenizer.json where it
trained with one) that `transformers.LlamaForCausalLM.from_pretrained(OUT_DIR)` loads and
`mpmd generate hf:OUT_DIR` continues prompts with.

    mpmd export runs/llama_tiny --hf exported/llama_tiny            # the newest committed step
    mpmd export runs/llama_tiny --hf exported/step_200 --step 200

The model's keys come from the run's resolved config (RUN_DIR/config.yaml), its parameters
from the checkpoint's `params/` leaves, read here by path (mpmd.train.checkpoint_reader.read_leaves):
the optimizer state is not read. `export_hf` checks everything before it reads a tensor (a run
directory, a committed step, model.kind llama, an OUT_DIR that does not exist or is empty) and
raises ExportError naming what was wrong; `main` prints it as one line and exits 2 (1 when
writing fails: a parent directory not writable, a full disk). OUT_DIR is
written beside itself and renamed into place (mpmd.recipes.families.hf.save): nothing is overwritten.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mpmd.recipes.families import hf
from mpmd.recipes.commands.arguments import non_negative

PARAMS = "params/"  # the checkpoint's parameter leaves (mpmd/stages/leaf_paths.py)


class ExportError(ValueError):
    """What `mpmd export` was given cannot be exported; the message says what and what is allowed."""


def export_hf(run_dir, out_dir, step: int | None = None, max_shard_bytes: int = hf.SHARD_BYTES) -> Path:
    """Writes committed `step` (default the newest) of the llama run in `run_dir` to `out_dir`
    as a Hugging Face model directory, as private as the run (its run_dir_mode); returns
    out_dir. ExportError on bad input."""
    from mpmd.recipes import config

    run, out = Path(run_dir), Path(out_dir)
    if not (run / "config.yaml").is_file():
        raise ExportError(f"{run} is not a run directory: it has no config.yaml (mpmd train writes one)")
    values = config.values_of(run / "config.yaml")
    kind = (values.get("model") or {}).get("kind")
    if kind not in hf.FAMILIES:
        raise ExportError(
            f"{run} trained model.kind={kind!r}; mpmd export --hf writes model.kind {', '.join(map(repr, hf.FAMILIES))}"
        )
    # The sizes are in the resolved config already: the directory it was initialised from
    # need not be there any more.
    values["model"]["init_from"] = None
    try:
        cfg = config.validate(values)
    except config.ConfigError as e:
        raise ExportError(f"{run / 'config.yaml'}: {e}") from None
    from mpmd.train.checkpoint_reader import committed_step, read_leaves

    try:
        step = committed_step(run, step)
    except ValueError as e:
        raise ExportError(str(e)) from None
    hf.check_new(out)
    try:
        _, leaves = read_leaves(run, step, prefix=PARAMS)
    except ValueError as e:  # a part missing or unreadable, a leaf that fails its digest
        raise ExportError(f"step {step} of {run} cannot be read: {e}") from None
    params = {name[len(PARAMS) :]: array for name, array in leaves.items()}
    # The run's own tokenizer goes with it (none for bytes), so `mpmd generate hf:OUT_DIR` decodes alike.
    from mpmd.recipes.data import tokenizer

    run_tok = tokenizer.run_tokenizer(run)
    keys = model_keys(cfg.model, params)
    extra = tokenizer_files(cfg.data.tokenizer, run_tok.hash)
    return hf.save(out, keys, params, run_tok.to_json(), int(cfg.run_dir_mode, 8), max_shard_bytes, extra_files=extra)


TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def tokenizer_files(spec: str, run_hash: str) -> dict[str, bytes]:
    """The files beside the run's tokenizer.json that say how it is used (its chat template,
    BOS/EOS, generation defaults): copied into the export where they are still there and the
    tokenizer.json beside them is the run's (same hash); {} otherwise (bytes, or moved)."""
    from mpmd.recipes.config import ConfigError
    from mpmd.recipes.data import tokenizer

    if spec == tokenizer.BYTES:
        return {}
    path = Path(spec).expanduser()
    folder = path if path.is_dir() else path.parent
    try:
        if tokenizer.load(str(path)).hash != run_hash:
            return {}
        return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}
    except (OSError, ConfigError):
        return {}


def model_keys(model, params: dict) -> dict:
    """The llama section's keys hf.save writes, resolved: num_kv_heads (null = num_heads) and
    mlp_dim (null = the model's default width) as the parameters have them."""
    keys = model.model_dump()
    keys["num_kv_heads"] = keys["num_kv_heads"] or keys["num_heads"]
    keys["mlp_dim"] = int(params["blocks.0.mlp.up.kernel"].shape[1])
    return keys


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd export",
        description="Write a run's committed checkpoint as a Hugging Face model directory in its "
        "family's format (llama, mistral, qwen2, qwen3, gemma3).",
        epilog="example: mpmd export runs/llama_tiny --hf exported/llama_tiny",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (mpmd train's run_dir)")
    parser.add_argument(
        "--hf",
        metavar="OUT_DIR",
        required=True,
        help="directory to write config.json and model.safetensors into; must not exist or be empty",
    )
    parser.add_argument("--step", type=non_negative(int), metavar="N", help="a committed step (default: the newest)")
    parser.add_argument(
        "--max-shard-size",
        type=byte_size,
        default=hf.SHARD_BYTES,
        metavar="SIZE",
        help="weights above this go into shards listed in model.safetensors.index.json, as "
        "save_pretrained does (bytes, or with KB, MB, GB: 1000-based; default 5GB)",
    )
    return parser


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def byte_size(text: str) -> int:
    """'5GB', '500MB', '20KB' or a count of bytes (1000-based, as transformers' max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B|B)?\s*", text.upper())
    if not match or float(match.group(1)) * _UNITS[match.group(2) or ""] < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: a positive number of bytes, or with KB, MB, GB")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        out = export_hf(args.run_dir, args.hf, args.step, args.max_shard_size)
    except (ExportError, hf.HFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # OUT_DIR's parent not writable, a full disk: nothing is left half-written
        print(f"error: cannot write {args.hf}: {e.strerror or e}", file=sys.stderr)
        return 1
    weights = out / (hf.INDEX if (out / hf.INDEX).exists() else hf.WEIGHTS)
    print(f"wrote {out / hf.CONFIG} and {weights}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
