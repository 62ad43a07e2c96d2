"""Hugging Face decoder checkpoints in and out (Llama 2 and 3.x, Mistral, Qwen 2.5, Qwen 3):
config.json <-> the family's model.* keys, safetensors tensors <-> the parameters of
models/llama.py's decoder by model path. FAMILIES is the table, one row per family: its
model.kind, model_type and architecture, and which of the decoder's switches config.json
sets (models/llama.py AttentionVariant).

    keys, params = hf.load("tiny_llama")     # {model.* key: value}, {param path: float32 np.ndarray}
    weights = hf.open("tiny_llama")          # lazily: weights.read(["blocks.0.attn.q.kernel", ...])
    hf.save("out", keys, params)             # config.json + model.safetensors for transformers

`weights.read` is what `mpmd.Trainer(init_params=...)` takes: each stage's tensors are read
from the safetensors files by name when its slice needs them (one file, or shards listed in
model.safetensors.index.json), so the controller holds one stage at a time, never the model.

The mapping is exact, no permutation: Hugging Face's LlamaAttention rotates q and k with
`rotate_half`, pairing dimensions (i, i + head_dim/2) with inverse frequency
theta^(-2i/head_dim), which is models/llama.rotary's layout; its query head h reads key/value
head h // (num_heads / num_kv_heads) (repeat_kv), as ours does; a torch Linear's weight is
[out, in] where an nnx.Linear's kernel is [in, out] (transposed both ways, so a round trip is
bitwise). What models/llama.py cannot compute is refused by name: rope scaling other than
"llama3" and "linear" (dynamic, yarn, longrope), biases other than Qwen 2.5's on q, k and v,
an activation other than SiLU, Qwen's per-layer sliding windows.

The formats themselves (FAMILIES, config.json's keys, tensor names) are data in
mpmd/recipes/families/hf_format.py, whose names this module gives too. Nothing here imports
JAX: the config's check reads config.json before JAX starts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from mpmd.recipes.families.hf_format import (  # noqa: F401  (hf.X: the formats, as one module)
    ARCHITECTURE,
    CONFIG,
    FAMILIES,
    GEMMA_KEYS,
    INDEX,
    KEYS,
    PREFIX,
    ROPE_KEYS,
    ROPE_TYPES,
    WEIGHTS,
    Family,
    HFError,
    _hf_shapes,
    directory_of,
    family_of,
    hf_config,
    max_positions,
    model_keys,
    param_paths,
    read_config,
    rope_scaling_of,
    rope_theta_of,
    tensor_name,
)


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def check_tensors(hf_dir, keys: dict) -> None:
    """The directory's tensors against what config.json says (`keys`, model_keys'), from the
    safetensors headers alone, before any model is built: the layers are there, no more and no
    fewer, and every tensor has its name, shape and a float dtype. HFError naming the first
    that disagrees; absurd sizes in config.json fail here in milliseconds."""
    weights = Weights(hf_dir)
    path = Path(hf_dir) / CONFIG
    layers = {
        int(name.split(".")[2])
        for name in weights.files
        if name.startswith("model.layers.") and name.split(".")[2].isdigit()
    }
    if layers != set(range(len(layers))) or len(layers) != keys["num_layers"]:
        raise HFError(
            f"{path} says num_hidden_layers={keys['num_layers']}, but {weights.dir}'s tensors are of "
            f"{len(layers)} layers{'' if layers == set(range(len(layers))) else ' (not numbered 0 up)'}"
        )
    shapes = _hf_shapes(keys)
    # The layer count is the files' now: every parameter's path is cheap to list.
    kind = keys.get("kind", "llama")
    for param in param_paths(keys):
        name, _ = tensor_name(param, kind)
        shape = shapes[param.split(".", 2)[2] if param.startswith("blocks.") else param]
        if name not in weights.files:
            raise HFError(f"{weights.dir} has no tensor {name!r}, which {path} implies")
        dtype, got = weights.header(name)
        if dtype not in _FLOAT_DTYPES:
            raise HFError(
                f"tensor {name!r} in {weights.files[name]} is {dtype}; a weight must be one of {_FLOAT_DTYPES}"
            )
        if tuple(got) != shape:
            raise HFError(
                f"tensor {name!r} in {weights.files[name]} has shape {list(got)}, but {path} implies {list(shape)}"
            )


class Weights:
    """A Hugging Face model directory's tensors, each read from its safetensors file when asked
    for by model path (`read`): one model.safetensors, or the shards its index lists."""

    def __init__(self, hf_dir):
        self.dir = Path(hf_dir)
        self.kind = family_of(hf_dir).kind
        self._headers: dict[Path, dict] = {}
        index, single = self.dir / INDEX, self.dir / WEIGHTS
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFError(f"cannot read {index}: {type(e).__name__}: {e} (it needs a 'weight_map')") from None
            self.files = {name: self.dir / file for name, file in weight_map.items()}
        elif single.is_file():
            self.files = {name: single for name in _names(single)}
        else:
            raise HFError(
                f"{self.dir} has neither {WEIGHTS} nor {INDEX}: save the model with "
                f"save_pretrained(dir, safe_serialization=True)"
            )

    def read(self, paths) -> list[np.ndarray]:
        """The float32 array of each model path, as models/llama.py lays it out. HFError
        naming the tensor that holds a NaN or an infinity."""
        out = []
        for path in paths:
            name, transposed = tensor_name(path, self.kind)
            if name not in self.files:
                raise HFError(f"{self.dir} has no tensor {name!r} (model parameter {path})")
            array = _read_tensor(self.files[name], name).astype(np.float32, copy=False)
            finite = np.isfinite(array)
            if not finite.all():
                bad = int(array.size - np.count_nonzero(finite))
                raise HFError(
                    f"tensor {name!r} in {self.files[name]} holds {bad} NaN or infinite value(s) of "
                    f"{array.size}: the weights are damaged; nothing was trained or generated from them"
                )
            out.append(np.ascontiguousarray(array.T) if transposed else array)
        return out

    def dtype_note(self) -> str | None:
        """One line saying the weights are not all float32 and are read as float32 (the run's
        parameters are float32 whatever model.dtype computes in); None when they are."""
        dtypes = sorted({self.header(name)[0] for name in self.files})
        if dtypes == ["F32"]:
            return None
        return (
            f"hf:{self.dir} holds {', '.join(dtypes)} weights: read as float32, the run's parameter "
            f"dtype (model.dtype sets what it computes in)"
        )

    def header(self, name: str) -> tuple[str, list[int]]:
        """(safetensors dtype, shape) of a tensor, from its file's header (no data read)."""
        from safetensors import SafetensorError, safe_open

        file = self.files[name]
        if file not in self._headers:
            try:
                with safe_open(str(file), "np") as f:
                    self._headers[file] = {
                        n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()
                    }
            except (OSError, SafetensorError) as e:
                raise HFError(f"cannot read {file}: {e}") from None
        if name not in self._headers[file]:
            raise HFError(f"{file} holds no tensor {name!r}, which {self.dir / INDEX} says it does")
        return self._headers[file][name]


def open(hf_dir) -> Weights:  # noqa: A001  (hf.open, as safetensors' safe_open)
    return Weights(hf_dir)


def load(hf_dir) -> tuple[dict, dict[str, np.ndarray]]:
    """(model.* keys of config.json, {model path: float32 array} of every parameter): the
    whole model in this process, for small models, tools and `mpmd generate hf:DIR`. The keys
    are the family's section's (`{"kind": family_of(hf_dir).kind, **keys}` validates as one), seq_len set to
    max_position_embeddings where config.json has it."""
    keys, longest = model_keys(hf_dir), max_positions(hf_dir)
    check_tensors(hf_dir, keys)
    if longest is not None:
        keys["seq_len"] = longest
    paths = param_paths(keys)
    return keys, dict(zip(paths, Weights(hf_dir).read(paths)))


SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default (max_shard_size="5GB")


def shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    """The tensor names in files of at most `max_bytes` each, in order (a tensor larger than
    that has a file of its own)."""
    out, size = [[]], 0
    for name, array in tensors.items():
        if out[-1] and size + array.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += array.nbytes
    return out


def save(
    out_dir,
    keys: dict,
    params: dict[str, np.ndarray],
    tokenizer_json: str | None = None,
    mode: int = 0o700,
    max_shard_bytes: int = SHARD_BYTES,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Writes config.json and the float32 weights of the decoder with model.* `keys`
    (keys["kind"]: the family whose format is written, default llama) and `params`
    ({model path: array}), and tokenizer.json where given (its text), into `out_dir`,
    which must not exist or be empty (HFError). The weights are model.safetensors, or above
    `max_shard_bytes` shards model-0000k-of-0000n.safetensors listed in
    model.safetensors.index.json, as save_pretrained writes them. `extra_files`: {name: bytes}
    written beside (the tokenizer's tokenizer_config.json, ...).
    the files are written beside it and renamed into place, so nothing half-written is left
    under that name and nothing is overwritten. The directory gets `mode` (default: its
    owner's only)."""
    from safetensors.numpy import save_file

    out = check_new(out_dir)
    expected = param_paths(keys)
    if sorted(expected) != sorted(params):
        missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        raise HFError(
            f"the parameters do not fit a Llama of these keys (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    tensors = {}
    for path in expected:
        name, transposed = tensor_name(path, keys.get("kind", "llama"))
        array = np.asarray(params[path], np.float32)
        tensors[name] = np.ascontiguousarray(array.T if transposed else array)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    staging = out.parent / f"{_partial_prefix(out)}{os.getpid()}"
    staging.mkdir()
    os.chmod(staging, mode)  # the directory is the gate: 0700, its owner's only, whatever the umask
    try:
        parts = shards(tensors, max_shard_bytes)
        if len(parts) == 1:
            save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        else:
            weight_map = {}
            for k, names in enumerate(parts, 1):
                file = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
                save_file({n: tensors[n] for n in names}, str(staging / file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, file))
            total = sum(a.nbytes for a in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (staging / CONFIG).write_text(json.dumps(hf_config(keys, keys.get("kind", "llama")), indent=2) + "\n")
        if tokenizer_json is not None:
            (staging / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        for name, data in (extra_files or {}).items():
            if Path(name).name != name or name in (CONFIG, WEIGHTS, INDEX, "tokenizer.json"):
                raise HFError(f"extra file {name!r}: a plain file name other than the model's own files")
            (staging / name).write_bytes(data)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def remove_stale_partials(out: Path) -> list[Path]:
    """Removes the staging directories beside `out` that an export killed before its rename
    left (`.NAME.partial-PID` of a PID no longer running); returns them."""
    removed = []
    for staging in out.parent.glob(f"{_partial_prefix(out)}*"):
        pid = staging.name[len(_partial_prefix(out)) :]
        if not pid.isdigit() or staging.is_symlink() or not staging.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its writer still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        shutil.rmtree(staging, ignore_errors=True)
        removed.append(staging)
    return removed


def check_new(out_dir) -> Path:
    """`out_dir` as a Path when it does not exist or is an empty directory (not a symbolic
    link: the rename would not land where it points); HFError otherwise."""
    out = Path(out_dir)
    if out.is_symlink():
        raise HFError(f"{out} is a symbolic link; name a new directory (nothing is written through a link)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFError(f"{out} exists and is not an empty directory; nothing is overwritten: name a new one")
    return out


def _names(file: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "np") as f:
            return list(f.keys())
    except (OSError, SafetensorError) as e:
        raise HFError(f"cannot read {file}: {e}") from None


def _read_tensor(file: Path, name: str) -> np.ndarray:
    """One tensor, read alone (safetensors maps the file). numpy has no bfloat16 of its own:
    such a tensor comes through JAX's (ml_dtypes), exactly."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "np") as f:
            if f.get_slice(name).get_dtype() != "BF16":
                return f.get_tensor(name)
        with safe_open(str(file), "flax") as f:
            return np.asarray(f.get_tensor(name))
    except (OSError, ValueError, SafetensorError) as e:
        raise HFError(f"cannot read tensor {name!r} from {file}: {e}") from None
