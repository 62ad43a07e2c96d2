"""Text from a trained model: a run directory's resolved config and committed checkpoint ->
the model on this process -> a continuation decoded with the key-value cache
(mpmd.models.decoding). `mpmd generate` (recipes/commands/generate.py) and the sample at the end
of `mpmd train` (recipes/run/train.py `sample`) both decode through `continue_text`.

    cfg, step, model = generate.load_run("runs/gpt_tiny")         # newest committed step
    text, num_new = generate.continue_text(model, generate.tokenizer_of("runs/gpt_tiny"), "def __init__(self",
                                           200, temperature=0)

Where it runs: on the controller, with no worker. The parameters are read from every slice's
Orbax directory of the checkpoint (mpmd.train.checkpoint_reader.read_leaves) into this process and
the model is built whole here, so a model must fit one host's memory to generate; decoding
pipelined over the slices is not built yet.

A Hugging Face Llama directory (`hf:DIR`, e.g. what `mpmd export` wrote) generates the same way
(`load_hf`): its config.json gives the model, its safetensors the weights (mpmd.recipes.families.hf).

Tokens: the run's own tokenizer (`tokenizer_of(run_dir)`: bytes, or the Hugging Face
tokenizer data.tokenizer named, as copied into the run directory); a model whose vocabulary
was padded past the tokenizer's (model.vocab_size) draws only among the tokenizer's ids.
"""

from __future__ import annotations

import sys

from pathlib import Path
import numpy as np

from mpmd.recipes import config as config_lib
from mpmd.recipes import registry
from mpmd.recipes.config import Config, ConfigError


# The longest window `hf:DIR` decodes in: its max_position_embeddings, at most this many tokens
# (a prefill runs the whole window, padded: 128k positions would make every prefill 128k long).
HF_MAX_WINDOW = 2048


def tokenizer_of(run_dir: str):
    """The tokenizer the run in run_dir trained with (its copy there, checked against the hash
    its run.json recorded; bytes for a byte-level run): mpmd.recipes.data.tokenizer.run_tokenizer.
    For `hf:DIR`, DIR's tokenizer.json (mpmd export copies the run's there), else bytes."""
    from mpmd.recipes.data import tokenizer

    if str(run_dir).startswith("hf:"):
        hf_dir = Path(str(run_dir)[len("hf:") :])
        return (
            tokenizer.load(str(hf_dir)) if (hf_dir / tokenizer.TOKENIZER_FILE).is_file() else tokenizer.ByteTokenizer()
        )
    return tokenizer.run_tokenizer(run_dir)


def load_run(run_dir: str, step: int | None = None) -> tuple[Config, int | None, object]:
    """(the run's resolved config, the checkpoint's step, its model with the checkpoint's
    parameters) of committed `step` (None: the newest). ConfigError with one line naming what
    is wrong: no such directory, not a run directory, no committed checkpoint, `step` not
    committed, a model kind that cannot generate. `hf:DIR` is a Hugging Face Llama directory
    instead (load_hf; its step is None)."""
    if str(run_dir).startswith("hf:"):
        if step is not None:
            raise ConfigError(
                f"{run_dir!r} is a Hugging Face directory: it has no steps (--step is for run directories)"
            )
        cfg, model = load_hf(run_dir)
        return cfg, None, model
    root = Path(run_dir)
    if not root.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} does not exist")
    if not (root / "config.yaml").is_file():
        raise ConfigError(f"{str(run_dir)!r} has no config.yaml: not a run directory of `mpmd train`")
    cfg = config_lib.load(root / "config.yaml")
    check_can_generate(cfg)
    from mpmd.train.checkpoint_reader import committed_step, read_leaves

    try:
        step = committed_step(run_dir, step)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    step, leaves = read_leaves(run_dir, step)
    return cfg, step, model_with(cfg, {k[len("params/") :]: v for k, v in leaves.items() if k.startswith("params/")})


def load_hf(spec: str) -> tuple[Config, object]:
    """(a config of the Llama that `hf:DIR`'s config.json describes, the model with its
    safetensors weights): model.seq_len its max_position_embeddings (at most HF_MAX_WINDOW),
    data.tokenizer DIR's tokenizer.json where it has one. ConfigError naming what is wrong."""
    from mpmd.recipes.families import hf
    from mpmd.recipes.data import tokenizer

    try:
        hf_dir = hf.directory_of(spec)
        keys, params = hf.load(hf_dir)
        note = hf.open(hf_dir).dtype_note()
    except hf.HFError as e:
        raise ConfigError(f"{spec!r}: {e}") from None
    if note:
        print(note, file=sys.stderr)
    has_tokenizer = (hf_dir / tokenizer.TOKENIZER_FILE).is_file()
    if not has_tokenizer and keys["vocab_size"] < 256:
        raise ConfigError(
            f"{spec!r} has no {tokenizer.TOKENIZER_FILE} and vocab_size={keys['vocab_size']}, fewer "
            f"than the 256 byte tokens: put the model's tokenizer.json in {hf_dir}"
        )
    model = {
        "kind": keys["kind"],
        "init_from": spec,
        "seq_len": min(keys.get("seq_len", HF_MAX_WINDOW), HF_MAX_WINDOW),
    }
    # The synthetic source reads no files: the config describes the model and its tokenizer only.
    data = {"source": "synthetic", **({"tokenizer": str(hf_dir)} if has_tokenizer else {})}
    cfg = config_lib.validate({"model": model, "data": data})
    return cfg, model_with(cfg, params)


def check_can_generate(cfg: Config) -> None:
    """ConfigError unless model.kind's family is a language model (its logits are tokens)."""
    if not registry.get_model_spec(cfg.model.kind).samples_text:
        texts = [name for name, spec in registry.model_specs().items() if spec.samples_text]
        raise ConfigError(
            f"model.kind={cfg.model.kind!r} cannot generate: only a language model can "
            f"(model.kind={registry.one_of(texts)})"
        )


def template_of(model) -> tuple | None:
    """What model_with needs to make `model` again without building it: (its graph, its
    parameters as shapes, its other state); None when `model` is not one nnx.Module or its
    other state is shapes only (built abstract). Shapes only: the template keeps no weights."""
    import jax
    from flax import nnx

    if not isinstance(model, nnx.Module):
        return None
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(rest)):
        return None
    return graph, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params), rest


def model_with(cfg: Config, params: dict, template: tuple | None = None) -> object:
    """model.kind's model built whole on this process, its parameters set from `params`
    ({path in the model: array}, the paths checkpoints name them by: mpmd.stages.leaf_paths).

    From `template` (template_of the model the run built), where given: nothing is built or
    traced again. Else built as shapes only where the family can and the model holds nothing
    but parameters, so the controller never holds a random initialisation beside the trained
    values; a model with other state (dropout's RNG streams, unused in eval mode) is
    initialised for real."""
    import jax
    from flax import nnx

    from mpmd.stages.leaf_paths import path_string

    spec = registry.get_model_spec(cfg.model.kind)

    def built(abstract: bool):
        model = spec.build(cfg, abstract)
        return model[0] if isinstance(model, tuple) else model  # a family may pair it with its loss

    if template is not None:
        model = nnx.merge(*template)
    else:
        model = built(spec.can_be_abstract(cfg))
        if jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param))):
            model = built(False)
    state = nnx.state(model, nnx.Param)
    flat, tree = jax.tree_util.tree_flatten_with_path(state)
    leaves, missing = [], []
    for keypath, now in flat:
        path = path_string(keypath)
        if path not in params:
            missing.append(path)
            continue
        got = np.asarray(params[path])
        if got.shape != now.shape:
            raise ConfigError(
                f"parameter {path} has shape {got.shape} in the checkpoint but "
                f"{tuple(now.shape)} in the model the config builds"
            )
        leaves.append(got.astype(now.dtype))
    if missing:
        raise ConfigError(
            f"the checkpoint has no parameter {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}: it was not saved from this model"
        )
    nnx.update(model, jax.tree.unflatten(tree, leaves))
    return model


def trainer_params(trainer) -> dict:
    """{path in the model: host array} of a Trainer's parameters as they are now."""
    import jax

    pipeline = trainer.pipeline
    return {
        path: leaf
        for paths, tree in zip(pipeline.param_paths, trainer.params())
        for path, leaf in zip(paths, jax.tree.leaves(tree))
    }


def continue_text(
    model,
    tokenizer,
    prompt: str,
    num_tokens: int,
    temperature: float,
    top_k: int = 0,
    seed: int = 0,
    cache: bool = True,
    decoder=None,
    chat: bool = False,
) -> tuple[str, int]:
    """(the prompt and its continuation by num_tokens tokens, as text; num_tokens), each token
    drawn by mpmd.models.decoding.next_token from a numpy generator seeded by `seed` (temperature
    0: greedy) among the tokenizer's ids. `decoder`: a Decoder of `model` already compiled (the
    timing of `mpmd generate`). `chat`: the prompt is a user message rendered by the
    tokenizer's chat template, and the text is the reply alone, up to its end-of-text token."""
    from mpmd.models import decoding

    if chat:
        # A user message, rendered for the reply: the reply alone is printed, up to the
        # end-of-text token.
        tokens, stop = np.asarray(_chat_tokens(tokenizer, prompt)), tokenizer.eos_id
        lead = len(tokens)
    else:
        tokens, stop = np.asarray(tokenizer.encode_prompt(prompt)).reshape(-1), None
        plain = np.asarray(tokenizer.encode(prompt)).reshape(-1)
        if len(plain) == 0:
            raise ConfigError("the prompt is empty: give some text to continue (--prompt)")
        # The special tokens the tokenizer puts before the prompt (a BOS) are not printed.
        lead = len(tokens) - len(plain) if np.array_equal(tokens[len(tokens) - len(plain) :], plain) else 0
    rng = np.random.default_rng(seed)
    decoder = decoder or decoding.Decoder(model)
    # The model's rows past the tokenizer's vocabulary (padding for the mesh) decode to nothing.
    vocab_size = tokenizer.vocab_size
    new = decoder.generate(
        tokens,
        num_tokens,
        lambda logits: decoding.next_token(logits[:vocab_size], temperature, top_k, rng),
        cache=cache,
        stop=stop,
    )
    return tokenizer.decode([*tokens[lead:].tolist(), *new]), len(new)


def _chat_tokens(tokenizer, message: str) -> list[int]:
    """A user `message` rendered by the tokenizer's chat template for the assistant's reply
    (recipes/data/chat.py), as tokens; ConfigError for a tokenizer without a template."""
    from mpmd.recipes.data import chat

    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ConfigError(
            "--chat needs a tokenizer with a chat_template in its tokenizer_config.json "
            f"(this one: {getattr(tokenizer, 'spec', tokenizer)}); without --chat the prompt is continued as text"
        )
    return tokenizer.encode_with_offsets(chat.reply_prompt(template, message))[0]


def sample_of(trainer, cfg, prompt: str, num_tokens: int, template: tuple | None = None) -> str:
    """The prompt and its continuation by num_tokens tokens, drawn as train.sample_temperature
    and train.sample_top_k say (mpmd.models.decoding.next_token), from a generator seeded by
    cfg.seed: the same run samples the same text: what a run of `mpmd train` ends with, decoded
    as `mpmd generate` decodes, with the key-value cache, from the trainer's parameters fetched
    to this process (made from `template`, template_of the run's model, where given)."""
    model = model_with(cfg, trainer_params(trainer), template)
    t = cfg.train
    return continue_text(
        model, tokenizer_of(cfg.run_dir), prompt, num_tokens, t.sample_temperature, t.sample_top_k, cfg.seed
    )[0]
