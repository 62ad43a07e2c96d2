"""Hugging Face Llama checkpoints in and out: config.json <-> the llama family's model.* keys,
safetensors tensors <-> the Llama's parameters by model path (models/llama.py).

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
bitwise). What models/llama.py cannot compute is refused by name: rope scaling (Llama 3.1's
"llama3", linear, dynamic, yarn), biases, an activation other than SiLU, a head_dim other
than hidden_size / num_attention_heads.

Nothing here imports JAX: the config's check reads config.json before JAX starts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from mpmd.recipes.config.sections import ConfigError

PREFIX = "hf:"  # model.init_from = "hf:<directory>"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"

# model.* key -> config.json key, and config.json's default when the key is absent (those of
# transformers' LlamaConfig). rope_theta has its own rule (rope_theta_of).
KEYS = {
    "vocab_size": ("vocab_size", None),
    "d_model": ("hidden_size", None),
    "num_heads": ("num_attention_heads", None),
    "num_layers": ("num_hidden_layers", None),
    "num_kv_heads": ("num_key_value_heads", None),
    "mlp_dim": ("intermediate_size", None),
    "norm_eps": ("rms_norm_eps", 1e-6),
    "tie_embeddings": ("tie_word_embeddings", False),
}
DEFAULT_ROPE_THETA = 10_000.0
_INT_KEYS = ("vocab_size", "d_model", "num_heads", "num_layers", "num_kv_heads", "mlp_dim")

# A block's parameter (path after blocks.<i>.) -> its tensor after model.layers.<i>., and
# whether the kernel is the tensor transposed.
_BLOCK = {
    "attn.q.kernel": ("self_attn.q_proj.weight", True),
    "attn.k.kernel": ("self_attn.k_proj.weight", True),
    "attn.v.kernel": ("self_attn.v_proj.weight", True),
    "attn.out.kernel": ("self_attn.o_proj.weight", True),
    "mlp.gate.kernel": ("mlp.gate_proj.weight", True),
    "mlp.up.kernel": ("mlp.up_proj.weight", True),
    "mlp.down.kernel": ("mlp.down_proj.weight", True),
    "attn_norm.scale": ("input_layernorm.weight", False),
    "mlp_norm.scale": ("post_attention_layernorm.weight", False),
}
_OUTER = {
    "embed.token.embedding": ("model.embed_tokens.weight", False),
    "head.norm.scale": ("model.norm.weight", False),
    "head.lm_head.kernel": ("lm_head.weight", True),
}


class HFError(ConfigError):
    """A Hugging Face directory mpmd cannot read as a Llama; the message names the file and key
    (a ConfigError: the commands print it as one line and exit 2)."""


def directory_of(init_from: str) -> Path:
    """The directory of model.init_from = "hf:<directory>"; HFError saying the form otherwise."""
    if not isinstance(init_from, str) or not init_from.startswith(PREFIX) or not init_from[len(PREFIX) :]:
        raise HFError(
            f"model.init_from must be 'hf:<directory>' (a Hugging Face Llama's config.json and "
            f"safetensors) or 'run:<directory>' (a llama run of mpmd train), got {init_from!r}"
        )
    return Path(os.path.expanduser(init_from[len(PREFIX) :]))


def read_config(hf_dir) -> dict:
    """config.json of `hf_dir` as a dict; HFError naming the file when it is missing or not JSON."""
    path = Path(hf_dir) / CONFIG
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFError(
            f"{path} not found: a Hugging Face model directory holds config.json and its "
            f"safetensors (save one with model.save_pretrained(dir))"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise HFError(f"{path} must hold a JSON object, got {type(values).__name__}")
    return values


def model_keys(hf_dir) -> dict:
    """The llama family's model.* keys config.json sets: sizes, GQA, RoPE theta, RMSNorm
    epsilon, tied embeddings (not seq_len: max_positions says how long it may be). HFError
    naming the key of what models/llama.py cannot compute."""
    c, path = read_config(hf_dir), Path(hf_dir) / CONFIG
    if c.get("model_type") != "llama" and ARCHITECTURE not in (c.get("architectures") or ()):
        raise HFError(
            f"{path}: model_type={c.get('model_type')!r}, architectures={c.get('architectures')!r}; "
            f"mpmd imports only model_type 'llama' ({ARCHITECTURE})"
        )
    refused = {
        "hidden_act": ("silu", c.get("hidden_act", "silu") != "silu"),
        "attention_bias": (False, bool(c.get("attention_bias", False))),
        "mlp_bias": (False, bool(c.get("mlp_bias", False))),
    }
    for key, (allowed, bad) in refused.items():
        if bad:
            raise HFError(f"{path}: {key}={c[key]!r}; models/llama.py computes only {key}={allowed!r}")
    out = {}
    for ours, (theirs, default) in KEYS.items():
        value = c.get(theirs, default)
        if value is None and ours == "num_kv_heads":
            value = c.get("num_attention_heads")
        if value is None:
            raise HFError(f"{path} has no {theirs!r} (model.{ours})")
        if ours in _INT_KEYS and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise HFError(f"{path}: {theirs}={value!r} must be a positive integer (model.{ours})")
        out[ours] = float(value) if ours == "norm_eps" else value
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim * out["num_heads"] != out["d_model"]:
        raise HFError(
            f"{path}: head_dim={head_dim} but hidden_size / num_attention_heads = "
            f"{out['d_model']} / {out['num_heads']}; models/llama.py needs them equal"
        )
    out["rope_theta"] = rope_theta_of(c, path)
    return out


def _hf_shapes(keys: dict) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor's shape ([out, in] for a projection) of each Llama parameter of
    model.* `keys`, by its model path without the layer (`blocks.<i>.`), as _BLOCK and _OUTER
    name them."""
    d, heads, kv, vocab, mlp = (keys[k] for k in ("d_model", "num_heads", "num_kv_heads", "vocab_size", "mlp_dim"))
    head_dim = d // heads
    return {
        "attn.q.kernel": (heads * head_dim, d),
        "attn.k.kernel": (kv * head_dim, d),
        "attn.v.kernel": (kv * head_dim, d),
        "attn.out.kernel": (d, heads * head_dim),
        "mlp.gate.kernel": (mlp, d),
        "mlp.up.kernel": (mlp, d),
        "mlp.down.kernel": (d, mlp),
        "attn_norm.scale": (d,),
        "mlp_norm.scale": (d,),
        "embed.token.embedding": (vocab, d),
        "head.norm.scale": (d,),
        "head.lm_head.kernel": (vocab, d),
    }


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
    for param in param_paths(keys["num_layers"], keys["tie_embeddings"]):
        name, _ = tensor_name(param)
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


def max_positions(hf_dir) -> int | None:
    """config.json's max_position_embeddings: the longest model.seq_len it was trained for."""
    return read_config(hf_dir).get("max_position_embeddings")


def rope_theta_of(c: dict, path) -> float:
    """RoPE's base: `rope_parameters.rope_theta` (transformers >= 5) or `rope_theta`; HFError
    for any rope type but the plain one (scaled frequencies are not models/llama.rotary's)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {"rope_type": rope}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise HFError(
            f"{path}: rope type {kind!r} ({'rope_parameters' if 'rope_parameters' in c else 'rope_scaling'}); "
            f"models/llama.py computes only the default rotary embedding (no scaling)"
        )
    return float(rope.get("rope_theta", c.get("rope_theta", DEFAULT_ROPE_THETA)))


def hf_config(keys: dict) -> dict:
    """config.json for a LlamaForCausalLM of the llama model.* keys `keys` (mlp_dim and
    num_kv_heads resolved: not None), float32 weights; max_position_embeddings = seq_len.
    RoPE's theta and the dtype are written as transformers 5 names them and, beside, as 4.x
    did (rope_theta, torch_dtype), so either reads them."""
    theta = float(keys["rope_theta"])
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
        "torch_dtype": "float32",
        "head_dim": keys["d_model"] // keys["num_heads"],
        "max_position_embeddings": keys["seq_len"],
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_theta": theta,
    }
    out.update({theirs: keys[ours] for ours, (theirs, _) in KEYS.items()})
    return out


def param_paths(num_layers: int, tie_embeddings: bool) -> list[str]:
    """Every parameter's model path of a Llama of these sizes (a tied one has no lm_head)."""
    blocks = [f"blocks.{i}.{p}" for i in range(num_layers) for p in _BLOCK]
    return ["embed.token.embedding", *blocks, "head.norm.scale", *([] if tie_embeddings else ["head.lm_head.kernel"])]


def tensor_name(path: str) -> tuple[str, bool]:
    """(Hugging Face tensor name, transposed) of a Llama parameter's model path; HFError for
    a path that is no Llama parameter."""
    if path in _OUTER:
        return _OUTER[path]
    head, _, rest = path.partition(".")
    index, _, inner = rest.partition(".")
    if head == "blocks" and index.isdigit() and inner in _BLOCK:
        name, transposed = _BLOCK[inner]
        return f"model.layers.{index}.{name}", transposed
    raise HFError(f"{path!r} is not a parameter of models/llama.py's Llama")


class Weights:
    """A Hugging Face model directory's tensors, each read from its safetensors file when asked
    for by model path (`read`): one model.safetensors, or the shards its index lists."""

    def __init__(self, hf_dir):
        self.dir = Path(hf_dir)
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
            name, transposed = tensor_name(path)
            if name not in self.files:
                raise HFError(f"{self.dir} has no tensor {name!r} (model parameter {path})")
            array = _read_tensor(self.files[name], name).astype(np.float32)
            finite = np.isfinite(array)
            if not finite.all():
                bad = int(array.size - np.count_nonzero(finite))
                raise HFError(
                    f"tensor {name!r} in {self.files[name]} holds {bad} NaN or infinite value(s) of "
                    f"{array.size}: the weights are damaged; nothing was trained or generated from them"
                )
            out.append(np.ascontiguousarray(array.T) if transposed else array)
        return out

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
    are a llama section's (`{"kind": "llama", **keys}` validates as one), seq_len set to
    max_position_embeddings where config.json has it."""
    keys, longest = model_keys(hf_dir), max_positions(hf_dir)
    check_tensors(hf_dir, keys)
    if longest is not None:
        keys["seq_len"] = longest
    paths = param_paths(keys["num_layers"], keys["tie_embeddings"])
    return keys, dict(zip(paths, Weights(hf_dir).read(paths)))


def save(
    out_dir, keys: dict, params: dict[str, np.ndarray], tokenizer_json: str | None = None, mode: int = 0o700
) -> Path:
    """Writes config.json and model.safetensors (float32) of a Llama with model.* `keys` and
    `params` ({model path: array}), and tokenizer.json where given (its text), into `out_dir`,
    which must not exist or be empty (HFError):
    the files are written beside it and renamed into place, so nothing half-written is left
    under that name and nothing is overwritten. The directory gets `mode` (default: its
    owner's only)."""
    from safetensors.numpy import save_file

    out = check_new(out_dir)
    expected = param_paths(keys["num_layers"], keys["tie_embeddings"])
    if sorted(expected) != sorted(params):
        missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        raise HFError(
            f"the parameters do not fit a Llama of these keys (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    tensors = {}
    for path in expected:
        name, transposed = tensor_name(path)
        array = np.asarray(params[path], np.float32)
        tensors[name] = np.ascontiguousarray(array.T if transposed else array)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    staging = out.parent / f"{_partial_prefix(out)}{os.getpid()}"
    staging.mkdir()
    os.chmod(staging, mode)  # the directory is the gate: 0700, its owner's only, whatever the umask
    try:
        save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(hf_config(keys), indent=2) + "\n")
        if tokenizer_json is not None:
            (staging / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
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
