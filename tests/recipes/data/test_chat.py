"""recipes/data/chat.py: chats rendered with a model's own chat template, the loss on its
assistant tokens. Held to transformers' apply_chat_template(..., return_assistant_tokens_mask=True)
on a ChatML template with {% generation %} blocks (Qwen's form), and, without the blocks, to
the same spans found by rendering the conversation's prefixes."""

import json
import sysconfig

import numpy as np
import pytest
import tokenizers

from mpmd.recipes.config import ConfigError
from mpmd.recipes.data import chat, tokenizer
from mpmd.recipes.commands import tokenizer as tokenizer_cli

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
UNMARKED = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CHATS = [
    [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 10 + 7?"},
        {"role": "assistant", "content": "It is 17, ünïcödé ✓."},
    ],
    [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "    return x * 2"}],
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A byte-level BPE with <|im_start|> and <|im_end|> as special tokens, and a
    tokenizer_config.json holding the ChatML template."""
    out = tmp_path_factory.mktemp("chat")
    stdlib = sysconfig.get_paths()["stdlib"]
    assert tokenizer_cli.main(["train", f"{stdlib}/textwrap.py", "--vocab-size", "300", "-o", str(out)]) == 0
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("messages", CHATS, ids=["two turns", "one turn"])
def test_tokens_and_assistant_mask_are_transformers(chat_dir, messages):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(chat_dir)).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ours = tokenizer.load(str(chat_dir))
    ids, trained = chat.encode(ours.chat_template, messages, ours)
    assert ids.tolist() == list(theirs["input_ids"])
    assert trained.astype(int).tolist() == list(theirs["assistant_masks"])
    assert trained.any() and not trained.all()
    im_end = ours._tok.token_to_id("<|im_end|>")
    assert [i for i, t in zip(ids, trained) if t].count(im_end) == sum(m["role"] == "assistant" for m in messages)


@pytest.mark.parametrize("messages", CHATS, ids=["two turns", "one turn"])
def test_without_generation_blocks_the_spans_are_found_by_rendering_prefixes(chat_dir, messages):
    ours = tokenizer.load(str(chat_dir))
    marked = chat.encode(chat.Template(CHATML), messages, ours)
    found = chat.encode(chat.Template(UNMARKED), messages, ours)
    assert marked[0].tolist() == found[0].tolist() and marked[1].tolist() == found[1].tolist()


def test_what_a_template_cannot_render_is_a_config_error(chat_dir):
    with pytest.raises(ConfigError, match="does not compile"):
        chat.Template("{% for m in messages %}")
    refusing = chat.Template("{{ raise_exception('system messages are not supported') }}")
    with pytest.raises(ConfigError, match="refused the messages: system messages are not supported"):
        refusing.render(CHATS[0])
    sandboxed = chat.Template("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ConfigError, match="refused the messages"):
        sandboxed.render(CHATS[0])
    assert np.asarray(tokenizer.load("bytes").chat_template is None)


def test_chat_sft_trains_on_the_templates_assistant_tokens_only(chat_dir, tmp_path):
    """data.source=jsonl with {"messages": ...} lines and a tokenizer with a chat template: each
    row's loss mask is 1 exactly on the targets that are assistant tokens (as transformers marks
    them), and `mpmd train` runs it through a 2-stage pipeline, scoring held-out chats by their
    last assistant span; `mpmd export` takes the template along."""
    from transformers import AutoTokenizer

    from mpmd.recipes import config
    from mpmd.recipes.data import loaders as data
    from mpmd.recipes.run import train

    lines = [{"messages": CHATS[i % 2]} for i in range(8)]
    for name in ("train.jsonl", "heldout.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = config.load(
        "configs/llama_sft.yaml",
        [
            f"data.path={tmp_path / 'train.jsonl'}",
            f"data.eval_path={tmp_path / 'heldout.jsonl'}",
            f"data.tokenizer={chat_dir}",
            "model.seq_len=128",
            "model.vocab_size=384",
            "train.steps=2",
            "train.batch_size=4",
            "train.eval_every=2",
            "train.exact_match=2",
            "train.sample_tokens=0",
            "pipeline.num_microbatches=2",
            "cluster.backend=inprocess",
            "log.trace_steps=[]",
            "log.tensorboard=false",
            "checkpoint.every=2",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    batch = data.make_loaders(cfg)[0].batch_at(0)
    theirs = AutoTokenizer.from_pretrained(str(chat_dir))
    for inputs, targets, mask in zip(batch["inputs"], batch["targets"], batch["loss_mask"]):
        tokens = np.concatenate([inputs[:1], targets])
        for messages in CHATS:
            want = theirs.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = list(want["input_ids"])
            if tokens[: len(ids)].tolist() == ids:
                break
        else:
            raise AssertionError("a row is none of the chats")
        assert mask[: len(ids) - 1].astype(int).tolist() == list(want["assistant_masks"])[1:]
        assert not mask[len(ids) - 1 :].any()  # the padding after it
    summary = train.run(cfg)
    assert summary["steps"] == 2
    # The export carries the tokenizer's config (its chat template) beside the run's tokenizer.
    from mpmd.recipes.commands.export import export_hf

    out = export_hf(cfg.run_dir, tmp_path / "exported")
    assert (out / "tokenizer_config.json").read_bytes() == (chat_dir / "tokenizer_config.json").read_bytes()
    assert tokenizer.load(str(out)).chat_template is not None


def test_generate_chat_replies_as_transformers_does(chat_dir, tmp_path, capsys):
    """`mpmd generate hf:DIR --chat --temperature 0`: the message rendered by the template for
    a reply, transformers' greedy tokens up to <|im_end|> (left out), decoded."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from mpmd.recipes.commands.generate import main
    from tests.support import hf_llama

    hf_dir = tmp_path / "model"
    reference = hf_llama.make("qwen2", hf_dir, vocab=384)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_dir / name, hf_dir / name)
    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    message = "2 + 3?"
    ids = theirs.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    im_end = theirs.convert_tokens_to_ids("<|im_end|>")
    out = reference.generate(
        torch.tensor([ids]),
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=im_end,
        suppress_tokens=list(range(len(theirs), 384)),
    )[0].tolist()[len(ids) :]
    reply = out[: out.index(im_end)] if im_end in out else out
    capsys.readouterr()
    args = [f"hf:{hf_dir}", "--chat", "--prompt", message, "--max-new-tokens", "12", "--temperature", "0"]
    assert main(args) == 0
    assert capsys.readouterr().out == theirs.decode(reply) + "\n"
    # Without a chat template, --chat is one error line.
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert main(args) == 2
    assert "--chat needs a tokenizer with a chat_template" in capsys.readouterr().err
