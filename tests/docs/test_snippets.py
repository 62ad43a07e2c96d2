"""The docs are code: a false claim in README.md or docs/*.md fails here, not in a reader's hands.

- Python: every ```python block runs, in page order, in one namespace per page (a page's later
  snippets use what its earlier ones defined), in a temporary working directory, with
  os.environ put back afterwards. A block right after `<!-- not run: REASON -->` is only
  compiled; keep that for what cannot run here or must not run in the test process (GPUs, Ray,
  several hosts, a registration other tests must not see, minutes of work) and say why. A page
  whose snippets start worker processes is `slow` (tests/README.md).
- Names: every dotted `mpmd.x.y` in inline code or in a Python block resolves, by import and
  getattr as Python itself would; every repository path in inline code (`recipes/data/sft.py`,
  `configs/gpt_tiny.yaml`) exists.
- Commands: every `mpmd COMMAND ...` line of a ```bash, ```sh or ```console block (in a console
  block, the lines after a `$ ` prompt) names a command of mpmd.recipes.cli.COMMANDS, parses
  with that command's own parser (nothing runs), and each `key=value` override names a key of
  the config schema (the keys `mpmd train --help-config` lists).
- Links: every relative link finds its file, and a `#fragment` a heading of that file.
- README's test command is the one `.ci/run` runs.
"""

import contextlib
import functools
import importlib
import inspect
import io
import os
import re
import shlex
import tokenize
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
# docs/benchmarks-history.md is a dated record, kept as it was: only its links are checked.
HISTORY = ROOT / "docs" / "benchmarks-history.md"
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p != HISTORY)]
# Launchers that start worker processes: a page whose snippets use one is slow.
WORKER_CLUSTERS = {"LocalCluster", "StaticCluster", "RayCluster", "SharedCluster"}
SHELL = {"bash", "sh", "shell", "console"}


class Block(NamedTuple):
    page: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason of a `<!-- not run: ... -->` right before the fence


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_page(path: Path) -> tuple[list[Block], str]:
    """The fenced blocks of a page (a fence indented in a list item loses that indent) and its
    text outside them, blank lines where the blocks were."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, prose, i = [], [], 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, lang = len(opening.group(1)), opening.group(2), opening.group(3).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence[0]) * len(fence)}\s*$", lines[i]):
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i])
            i += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        note = re.match(r"^\s*<!--\s*not run:\s*(.+?)\s*-->\s*$", before)
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", note.group(1) if note else None))
        prose.extend([""] * (i + 1 - start))
        i += 1
    return blocks, "\n".join(prose)


PARTS = {page: split_page(page) for page in PAGES}


def python_blocks(page: Path, run: bool) -> list[Block]:
    return [b for b in PARTS[page][0] if b.lang == "python" and (b.not_run is None) == run]


def compiled(block: Block):
    # Leading newlines put each line at its line of the page in a traceback.
    return compile("\n" * block.line + block.code, rel(block.page), "exec")


def names_in(code: str) -> set:
    return {t.string for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type == tokenize.NAME}


def run_params():
    for page in PAGES:
        blocks = python_blocks(page, run=True)
        if blocks:
            slow = any(names_in(b.code) & WORKER_CLUSTERS for b in blocks)
            yield pytest.param(page, id=rel(page), marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("page", list(run_params()))
def test_python_snippets_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    environ = dict(os.environ)  # a snippet may ask for host devices, as a reader's script does
    namespace = {"__name__": "__docs__"}
    try:
        for block in python_blocks(page, run=True):
            exec(compiled(block), namespace)
    finally:
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=f"{rel(b.page)}:{b.line}") for page in PAGES for b in python_blocks(page, run=False)]
)
def test_snippets_not_run_compile_and_say_why(block):
    assert len(block.not_run) > 20, f"{rel(block.page)}:{block.line}: say why the snippet does not run"
    compiled(block)


# -- names ------------------------------------------------------------------------------------
DOTTED = re.compile(r"(?<![\w./-])mpmd(?:\.[A-Za-z_]\w*)+")


def resolve(dotted: str):
    """What `dotted` is at run time: attributes first, a submodule not yet imported otherwise."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                raise AttributeError(f"{'.'.join(parts[: i - 1])} has no attribute {part!r}") from None
    return obj


def doc_names():
    found = {}
    for page in PAGES:
        blocks, prose = PARTS[page]
        spans = re.findall(r"`([^`]+)`", prose)
        for text in spans + [b.code for b in blocks if b.lang == "python"]:
            for name in DOTTED.findall(text):
                found.setdefault(name, rel(page))
    return sorted(found.items())


@pytest.mark.parametrize("name, page", doc_names())
def test_mpmd_names_resolve(name, page):
    try:
        resolve(name)
    except (AttributeError, ImportError) as e:
        pytest.fail(f"{page} names `{name}`, which does not resolve: {e}")


# -- paths --------------------------------------------------------------------------------------
REPO_PATH = re.compile(r"^(?:mpmd|runtime|models|recipes|tests|benchmarks|configs|docs|\.ci)/[\w./-]*$")


def doc_paths():
    found = {}
    for page in PAGES:
        for span in re.findall(r"`([^`]+)`", PARTS[page][1]):
            for word in re.split(r"[\s,()\[\]]+", span):
                if REPO_PATH.match(word):
                    found.setdefault(word.rstrip("."), rel(page))
    return sorted(found.items())


@pytest.mark.parametrize("path, page", doc_paths())
def test_repository_paths_exist(path, page):
    if not (ROOT / path).exists():
        pytest.fail(f"{page} names `{path}`, which is not in the repository")


# -- commands -----------------------------------------------------------------------------------
def shell_lines(block: Block):
    """The command lines of a shell block: continuations joined, heredocs skipped; in a console
    block only the lines after a prompt (`$ `, `host$ `)."""
    lines, out, i = block.code.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if block.lang == "console":
            prompt = re.match(r"^\s*[\w.-]*\$\s+(.*)$", line)
            if not prompt:
                continue
            line = prompt.group(1)
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        out.append(line)
    return out


def mpmd_commands(line: str):
    """argv after `mpmd` for each mpmd command of a shell line (`a && mpmd b; X=1 mpmd c`)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    tokens = list(lexer)
    commands, current = [], []
    for token in tokens + [";"]:
        if token in ("&&", "||", ";", "|", "(", ")"):
            while current and re.match(r"^[A-Za-z_]\w*=", current[0]):
                current.pop(0)  # VAR=value before a command
            if current and os.path.basename(current[0]) == "mpmd":
                commands.append(current[1:])
            current = []
        else:
            current.append(token)
    return commands


def doc_commands():
    for page in PAGES:
        for block in PARTS[page][0]:
            if block.lang not in SHELL:
                continue
            for line in shell_lines(block):
                try:
                    commands = mpmd_commands(line)
                except ValueError:  # not shell we can read (a `python -c "` spanning lines)
                    if re.search(r"(^|[\s/])mpmd\s", line):
                        commands = [["<unreadable>", line]]
                    else:
                        continue
                for argv in commands:
                    yield pytest.param(argv, id=f"{rel(page)}:{block.line}:{' '.join(argv)[:60]}")


@pytest.fixture(scope="module")
def schema_keys():
    from mpmd.recipes.config.loading import leaf_keys

    return set(leaf_keys())


@pytest.mark.parametrize("argv", list(doc_commands()))
def test_mpmd_command_lines_parse(argv, schema_keys):
    from mpmd.recipes.cli import COMMANDS

    name, rest = argv[0] if argv else "", argv[1:]
    if name in ("--version", "-V", "--help", "-h") and not rest:
        return
    if name not in COMMANDS:
        pytest.fail(f"`mpmd {' '.join(argv)}`: no command {name!r}; the commands are {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[name][0])
    if hasattr(module, "parse_args"):  # mpmd worker: parses and checks what argparse cannot
        parse = module.parse_args
    else:  # as the command's main parses
        parser = module.parser()
        intermixed = "parse_intermixed_args" in inspect.getsource(module.main)
        parse = parser.parse_intermixed_args if intermixed else parser.parse_args
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parse(rest)
    except SystemExit as e:
        assert e.code == 0, f"`mpmd {' '.join(argv)}` does not parse: {err.getvalue().strip()}"
        return
    config = getattr(args, "config", None)
    if isinstance(config, str) and config.startswith("configs/"):
        assert (ROOT / config).is_file(), f"`mpmd {' '.join(argv)}`: {config} does not exist"
    overrides = list(getattr(args, "overrides", None) or [])
    if name == "tokenize" and args.inputs[0].endswith((".yaml", ".yml")):
        overrides = args.inputs[1:]
    for override in overrides:
        key = override.partition("=")[0]
        if key not in schema_keys:
            pytest.fail(f"`mpmd {' '.join(argv)}`: {key!r} is no config key (`mpmd train --help-config` lists them)")


# -- links --------------------------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set:
    prose = split_page(page)[1]
    return {slug(m.group(1).replace("`", "")) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M)}


def doc_links():
    for page in [*PAGES, HISTORY]:
        for target in re.findall(r"\]\(([^)\s]+)\)", split_page(page)[1]):
            if not re.match(r"^[a-z]+:", target):
                yield pytest.param(page, target, id=f"{rel(page)}->{target}")


@pytest.mark.parametrize("page, target", list(doc_links()))
def test_links_find_their_page_and_heading(page, target):
    path, _, fragment = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{rel(page)} links to {target}: no such file"
    if fragment and dest.suffix == ".md":
        if fragment not in anchors(dest):
            pytest.fail(f"{rel(page)} links to {target}: {rel(dest)} has no such heading")


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r'README\'s test command\)" bash -c \\\s*"([^"]+)"', ci).group(1)
    readme = [b for b in PARTS[ROOT / "README.md"][0] if b.lang == "bash"]
    assert any(command in b.code.splitlines() for b in readme), f"README.md no longer shows .ci/run's {command!r}"
