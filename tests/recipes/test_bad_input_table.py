"""A table of bad values fed to every config key and every numeric option of every command:
each is refused as one line naming the key (ConfigError; argparse's usage error, exit 2),
never a traceback, and a value a key takes is a config that loads. The counts are printed
(`pytest -s`)."""

import argparse
import importlib

import pytest

from mpmd.recipes import config

BAD_VALUES = [
    "-1",
    "0",
    "-0.5",
    ".inf",
    "-.inf",
    ".nan",
    "1e30",
    str(10**22),
    "x",
    "''",
    "[1]",
    "{a: 1}",
    "true",
    "null",
]
CONFIGS = ["configs/gpt_tiny.yaml", "configs/llama_tiny.yaml", "configs/moe_tiny.yaml", "configs/mlp.yaml"]


def leaves(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_config_key_refuses_bad_values_as_a_config_error():
    tried, refused, broken = 0, 0, []
    for file in CONFIGS:
        for key in leaves(config.load(file).model_dump()):
            for value in BAD_VALUES:
                tried += 1
                try:
                    config.load(file, [f"{key}={value}"])
                except config.ConfigError as e:
                    refused += 1
                    assert str(e).strip() and "Traceback" not in str(e)
                except Exception as e:  # anything else would reach the user as a traceback
                    broken.append(f"{file} {key}={value}: {type(e).__name__}: {e}")
    print(f"config keys: {tried} bad values tried, {refused} refused, {tried - refused - len(broken)} taken")
    assert broken == []


# Each command with the arguments it requires, so that only the option under test is wrong.
COMMANDS = {
    "train": ["configs/gpt_tiny.yaml"],
    "generate": ["runs/x", "--prompt", "x"],
    "tune": ["configs/gpt_tiny.yaml"],
    "plan": ["goodput", "configs/gpt_tiny.yaml"],
    "tokenizer": ["train", "a.txt", "--vocab-size", "300", "-o", "out"],
    "tokenize": ["a.txt", "-o", "out"],
    "sft_data": ["-o", "out"],
    "export": ["runs/x", "--hf", "out"],
    "cluster": ["up"],
}
NUMERIC_BAD = ["-1", "nan", "inf", "-inf", "1e400", "x", ""]


def numeric_options(parser: argparse.ArgumentParser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name == (COMMANDS.get(parser.prog.split()[-1]) or [None])[0]:
                    yield from numeric_options(sub, (name,))
        elif action.option_strings and action.type not in (None, str):
            yield prefix, action.option_strings[-1]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_numeric_option_refuses_bad_values_in_one_line_exit_2(command, capsys):
    parser = importlib.import_module(f"mpmd.recipes.commands.{command}").parser()
    options = list(numeric_options(parser))
    tried = 0
    for _, option in options:
        for value in NUMERIC_BAD:
            tried += 1
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args([*COMMANDS[command], option, value])
            err = capsys.readouterr().err.strip().splitlines()
            assert exit_.value.code == 2, (option, value)
            assert err[-1].startswith(f"{parser.prog}") and f"argument {option}" in err[-1], (option, value, err)
    print(f"mpmd {command}: {len(options)} numeric options, {tried} bad values, all refused")
