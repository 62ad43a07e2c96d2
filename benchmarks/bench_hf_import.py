"""What the controller holds while a pipeline starts from Hugging Face weights (model.init_from).

    .venv/bin/python benchmarks/bench_hf_import.py [--layers N] [--d-model N] [--stages N]

Writes a random Llama in Hugging Face's format (config.json + sharded safetensors, float32;
by default d_model 1024, 16 layers, vocab 32000: about 1 GB), then, in a fresh controller
process each, starts `--stages` local worker processes and a Trainer on them twice:

  import   init_params = hf.open(dir).read: each stage's tensors are read on the controller
           one stage at a time and sent to its slice (mpmd/train/programs.py materialize)
  seeded   the same abstract model initialised on its slices (no weights read): the
           controller's own floor (JAX, the lowered programs)

and prints each controller's peak resident set (ru_maxrss) against the bytes of the whole
model and of its largest stage. Nothing is timed; the workers' memory is not counted.
"""

from __future__ import annotations

import cpu_setup  # noqa: I001  (first: before anything imports jax)

REPO = cpu_setup.before_jax(devices=1)

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402


def write_model(out: Path, d_model: int, layers: int, vocab: int, mlp: int, heads: int, kv: int) -> int:
    """A random float32 Llama of these sizes in `out` (5 shards at most 300 MB each, written one
    layer at a time); returns its parameter bytes."""
    from safetensors.numpy import save_file

    from mpmd.recipes.families import hf

    keys = dict(
        kind="llama",
        vocab_size=vocab,
        d_model=d_model,
        num_heads=heads,
        num_kv_heads=kv,
        num_layers=layers,
        mlp_dim=mlp,
        norm_eps=1e-5,
        tie_embeddings=False,
        rope_theta=500_000.0,
        seq_len=64,
    )
    shapes = hf._hf_shapes(keys)
    rng = np.random.default_rng(0)
    out.mkdir(parents=True)
    weight_map, total, part, size, files = {}, 0, {}, 0, 0

    def flush():
        nonlocal part, size, files
        if part:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(part, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
            part, size = {}, 0

    for path in hf.param_paths(keys):
        name, _ = hf.tensor_name(path)
        shape = shapes[path.split(".", 2)[2] if path.startswith("blocks.") else path]
        array = (rng.standard_normal(shape, np.float32) * 0.02) if len(shape) == 2 else np.ones(shape, np.float32)
        part[name] = array
        size += array.nbytes
        total += array.nbytes
        if size > 300e6:
            flush()
    flush()
    (out / hf.INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / hf.CONFIG).write_text(json.dumps(hf.hf_config(keys)))
    return total


def controller(hf_dir: str, stages: int, mode: str) -> None:
    """One Trainer on `stages` local workers from `hf_dir` (mode import) or seeded; prints
    {"peak": this process's ru_maxrss bytes, "stage_bytes": [...]} as JSON."""
    import optax

    import mpmd
    from mpmd.recipes import config, registry
    from mpmd.recipes.run import build

    cfg = config.load(
        None, ["model.kind=llama", f"model.init_from=hf:{hf_dir}", f"pipeline.num_stages={stages}", "model.seq_len=64"]
    )
    sample = np.zeros((1, 64), np.int32)
    stages_, loss_fn = build.build_model(cfg, sample, abstract=True)
    pipe = mpmd.Pipeline(stages_, loss_fn, sample_input=sample)
    init = registry.get_model_spec("llama").init_params(cfg) if mode == "import" else None
    cluster = mpmd.LocalCluster(num_workers=stages)
    trainer = mpmd.Trainer(
        pipe, optax.sgd(0.1), schedule="gpipe", num_microbatches=1, cluster=cluster, init_params=init
    )
    trainer.close()
    stage_bytes = [sum(int(np.prod(leaf.shape)) * 4 for leaf in fn.param_leaves) for fn in pipe.fns]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak, "stage_bytes": stage_bytes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--controller", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.controller:
        controller(args.controller[0], args.stages, args.controller[1])
        return
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "model"
        d = args.d_model
        total = write_model(hf_dir, d, args.layers, args.vocab, mlp=(8 * d // 3 + 63) // 64 * 64, heads=16, kv=4)
        print(f"model: {total / 1e6:.0f} MB of float32 parameters, {args.stages} stages, written to {hf_dir}")
        for mode in ("import", "seeded"):
            cmd = [sys.executable, __file__, "--stages", str(args.stages), "--controller", str(hf_dir), mode]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
            if proc.returncode:
                sys.exit(f"{mode} failed:\n{proc.stderr[-4000:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            largest = max(got["stage_bytes"])
            print(
                f"{mode:>7}: controller peak RSS {got['peak'] / 1e6:7.0f} MB = {got['peak'] / total:.2f} x the "
                f"model, {got['peak'] / largest:.2f} x its largest stage ({largest / 1e6:.0f} MB)"
            )


if __name__ == "__main__":
    main()
