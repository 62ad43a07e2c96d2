"""docs/reference/config.md and docs/reference/cli.md, made from the config schema and the
commands' own argument parsers, so the reference cannot say what the code does not.

    python -m mpmd.recipes.reference [DOCS_DIR]     # (re)writes DOCS_DIR/reference/*.md

tests/recipes/test_reference.py fails when the pages on disk differ from what this makes.
The CLI page is built from each parser's actions, not from argparse's --help text, whose
layout changes between Python versions (3.13 prints `-o, --output OUT` where 3.11 prints
`-o OUT, --output OUT`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from mpmd.recipes import config
from mpmd.recipes.cli import COMMANDS

CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"
_MADE_BY = "<!-- made by `python -m mpmd.recipes.reference docs`; edit the schema or the parser, not this page -->"


def config_page() -> str:
    """Every config key with its default, description and allowed values."""
    return (
        f"{_MADE_BY}\n# Configuration reference\n\n"
        "Every key of a run's config, with its default and what it means, as `mpmd train --help-config` "
        "prints it. A YAML file holds only what differs from these; `key=value` on the command line "
        "overrides the file; an unknown key is refused. `model.*` and `cluster.*` are shown as the "
        "default family and backend take them, with what each other registered one adds as comments.\n\n"
        f"```yaml\n{config.describe()}\n```\n"
    )


def _parser_of(module: str) -> argparse.ArgumentParser:
    return importlib.import_module(module).parser()


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`" + (" ..." if action.nargs in ("*", "+") else "")
    takes = action.nargs != 0
    metavar = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
    )
    return ", ".join(f"`{s} {metavar}`" if takes else f"`{s}`" for s in action.option_strings)


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _command(name: str, parser: argparse.ArgumentParser, level: int = 2) -> list[str]:
    lines = [f"{'#' * level} `{name}`", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    rows = []
    subcommands = []
    for action in parser._actions:  # argparse keeps its actions there; it has no public list
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            subcommands += list(action.choices.items())
            continue
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or action.required else f"{default}"
        rows.append(f"| {_option(action)} | {_cell(action.help)} | {_cell(shown)} |")
    if rows:
        lines += ["| argument | meaning | default |", "|---|---|---|", *rows, ""]
    if parser.epilog:
        lines += ["```", parser.epilog.strip(), "```", ""]
    for verb, sub in subcommands:
        lines += _command(f"{name} {verb}", sub, level + 1)
    return lines


def cli_page() -> str:
    """Every `mpmd` command with its arguments, defaults and examples."""
    lines = [
        _MADE_BY,
        "# Command reference",
        "",
        "`mpmd COMMAND --help` prints the same; `mpmd --version` prints mpmd's, JAX's and Python's versions.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`mpmd {name}`](#mpmd-{name}) | {_cell(doc)} |" for name, (_, doc) in COMMANDS.items()]
    lines.append("")
    for name, (module, _) in COMMANDS.items():
        lines += _command(f"mpmd {name}", _parser_of(module))
    return "\n".join(lines).rstrip() + "\n"


def pages() -> dict[str, str]:
    """{path under docs/: text}."""
    return {CONFIG_PAGE: config_page(), CLI_PAGE: cli_page()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    docs = Path(argv[0] if argv else "docs")
    if not docs.is_dir():
        print(f"error: {docs} is not a directory (give the repository's docs/)", file=sys.stderr)
        return 2
    for path, text in pages().items():
        (docs / path).parent.mkdir(parents=True, exist_ok=True)
        (docs / path).write_text(text)
        print(f"wrote {docs / path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
