"""recipes/run/generate.py on a Hugging Face Llama directory (`mpmd generate hf:DIR`, in this process):
greedy decoding with the key-value cache draws the tokens transformers' own greedy `generate`
draws from the same directory, and what hf:DIR cannot be is one error line with exit status 2."""

import numpy as np
import pytest

from mpmd.recipes.run import generate
from mpmd.recipes.commands.generate import main
from tests.support import hf_llama

PROMPT, NEW = "def f(x", 20  # 7 + 20 tokens: within the model's 32 positions, no window shift


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "gqa"
    return out, hf_llama.make("gqa", out)


def test_greedy_generate_of_an_hf_directory_draws_transformers_tokens(hf_dir, capsys):
    import torch

    out, reference = hf_dir
    reference.generation_config.eos_token_id = None  # all NEW tokens, as mpmd draws them
    want = reference.generate(
        torch.tensor([list(PROMPT.encode())]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
    )[0].tolist()
    assert main([f"hf:{out}", "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0"]) == 0
    printed = capsys.readouterr()
    cfg, step, model = generate.load_run(f"hf:{out}")
    assert step is None and cfg.model.seq_len == 2 * hf_llama.SEQ_LEN and cfg.model.num_kv_heads == 2
    from mpmd.models import decoding

    got = decoding.Decoder(model).generate(
        np.frombuffer(PROMPT.encode(), np.uint8), NEW, lambda logits: int(np.argmax(logits))
    )
    assert [*PROMPT.encode(), *got] == want
    assert printed.out == generate.tokenizer_of(f"hf:{out}").decode(want) + "\n"
    assert f"hf:{out}: {NEW} new tokens in" in printed.err and "key-value cache" in printed.err


@pytest.mark.parametrize(
    "args, says",
    [
        (["hf:/nonexistent/model"], "config.json not found"),
        (["hf:"], "must be 'hf:<directory>'"),
        (["hf:DIR", "--step", "3"], "has no steps"),
    ],
)
def test_what_hf_dir_cannot_be_is_one_error_line(hf_dir, capsys, args, says):
    args = [a.replace("DIR", str(hf_dir[0])) for a in args]
    assert main([*args, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1, err
