"""Import structure: the schedule tools load without JAX, the package's public names load
lazily, and mpmd's modules import in any order (their imports form a DAG)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import mpmd

ROOT = Path(__file__).resolve().parent.parent


def run_python(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_schedule_modules_do_not_import_jax():
    proc = run_python(
        "-c",
        "import sys, mpmd.schedules, mpmd.schedules.simulate, mpmd.schedules.render, mpmd.schedules.cli; "
        "assert 'jax' not in sys.modules, 'jax was imported'",
    )
    assert proc.returncode == 0, proc.stderr


def test_schedule_command_does_not_import_jax(tmp_path):
    code = (
        "import sys; from mpmd.recipes import cli; "
        f"rc = cli.main(['schedule', '1f1b', '--stages', '4', '--microbatches', '8', '-o', {str(tmp_path / 'a.svg')!r}]); "
        "assert rc == 0, rc; assert 'jax' not in sys.modules, 'jax was imported'"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert "bubble fraction" in proc.stdout and (tmp_path / "a.svg").exists()


@pytest.mark.parametrize(
    "name, module",
    [
        ("abstract", "mpmd.stages.abstract"),
        ("Pipeline", "mpmd.stages.pipeline"),
        ("Trainer", "mpmd.train.trainer"),
        ("Checkpointing", "mpmd.train.options"),
        ("Recovery", "mpmd.train.options"),
        ("Mesh", "mpmd.train.layout"),
        ("split", "mpmd.stages.split"),
        ("stage_boundary", "mpmd.stages.marks"),
        ("tune", "mpmd.tuner.core"),
        ("Rewound", "mpmd.train.checkpoints"),
        ("InProcessCluster", "mpmd.runtime.control.inprocess"),
        ("LocalCluster", "mpmd.runtime.launchers.local"),
        ("RayCluster", "mpmd.runtime.launchers.ray"),
        ("StaticCluster", "mpmd.runtime.launchers.static"),
        ("WorkerLost", "mpmd.runtime.control.cluster"),
        ("Groups", "mpmd.groups.client"),
    ],
)
def test_public_names_resolve_lazily(name, module):
    value = getattr(mpmd, name)
    assert value is getattr(sys.modules[module], name)
    assert name in mpmd.__all__ and name in dir(mpmd)


def test_public_names_are_exactly_all():
    assert sorted(mpmd.__all__) == sorted(
        [
            "abstract",
            "Pipeline",
            "Trainer",
            "Checkpointing",
            "Recovery",
            "Mesh",
            "split",
            "stage_boundary",
            "add_loss",
            "collect_losses",
            "tune",
            "InProcessCluster",
            "LocalCluster",
            "RayCluster",
            "StaticCluster",
            "Rewound",
            "NonFinite",
            "WorkerLost",
            "constrain",
            "Groups",
        ]
    )


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        mpmd.no_such_name  # noqa: B018
    assert not hasattr(mpmd, "no_such_name")


def test_submodules_are_attributes_on_first_use():
    proc = run_python(
        "-c",
        "import mpmd, sys; assert 'mpmd.schedules' not in sys.modules; "
        "assert mpmd.schedules.gpipe(2, 2).placement == (0, 1); "
        "assert 'jax' not in sys.modules",
    )
    assert proc.returncode == 0, proc.stderr


def test_split_stays_the_function_after_importing_the_submodule():
    # Importing the submodule mpmd.split must not replace the public function mpmd.split.
    proc = run_python(
        "-c",
        "import mpmd.stages.split, mpmd; from mpmd.stages.split import balanced_boundaries; "
        "import inspect; assert inspect.isfunction(mpmd.split), mpmd.split",
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "first, second", [("mpmd.stages.split", "mpmd.stages.marks"), ("mpmd.stages.marks", "mpmd.stages.split")]
)
def test_marks_and_split_import_in_either_order(first, second):
    proc = run_python(
        "-c", f"import {first}, {second}; import mpmd; assert callable(mpmd.split) and callable(mpmd.stage_boundary)"
    )
    assert proc.returncode == 0, proc.stderr


def test_every_package_folder_is_installed_under_mpmd():
    # pyproject lists the packages by hand (runtime/, models/ and recipes/ install as
    # mpmd.runtime, mpmd.models, mpmd.recipes): a new folder left off the list would be
    # missing from a wheel, though an editable install still finds it.
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    where = {"mpmd": "mpmd", **{name: folder for name, folder in config["package-dir"].items()}}
    found = set()
    for name, folder in where.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == listed, f"installed packages {sorted(listed)} differ from the folders {sorted(found)}"
    for top in ("runtime", "models", "recipes"):
        proc = run_python(
            "-c",
            f"import importlib.util, sys; sys.path.remove(''); "
            f"assert importlib.util.find_spec({top!r}) is None, 'a top-level {top} is installed'",
        )
        assert proc.returncode == 0, proc.stderr


def _modules() -> dict[str, Path]:
    """mpmd's modules by dotted name (runtime/, models/, recipes/ as mpmd.runtime, ...)."""
    import tomllib

    dirs = {"mpmd": "mpmd", **tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]}
    mods = {}
    for pkg, folder in dirs.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            if pkg == "mpmd" and parts and f"mpmd.{parts[0]}" in dirs:
                continue
            mods[".".join([pkg, *parts])] = f
    return mods


def _imports(path: Path, name: str, mods, inside_functions: bool) -> set[str]:
    """The mpmd modules `path` imports: at its top level, or anywhere but under `if
    TYPE_CHECKING:`; `mpmd` itself (its names load lazily) left out."""

    def found(module: str) -> str | None:
        while module and module not in mods:
            module = module.rpartition(".")[0]
        return module if module not in ("", "mpmd", name) else None

    def walk(nodes):
        for n in nodes:
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                continue
            yield n
            if inside_functions:
                yield from walk(ast.iter_child_nodes(n))

    out = set()
    for n in walk(ast.parse(path.read_text()).body):
        if isinstance(n, ast.Import):
            out |= {found(a.name) for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - n.level + 1] + ([n.module] if n.module else []))
            out |= {found(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base) for a in n.names}
    return out - {None}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                out.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_modules_import_each_other_without_cycles():
    """At their top level mpmd's modules form a DAG. Counting the imports inside functions
    too, the only cycle is the recipes' registry, which imports a family, data source or
    backend when it is first named (and they import the registry to register)."""
    mods = _modules()
    top = {m: _imports(p, m, mods, inside_functions=False) for m, p in mods.items()}
    assert _cycles(top) == []
    deep = {m: _imports(p, m, mods, inside_functions=True) for m, p in mods.items()}
    cycles = _cycles(deep)
    assert all(all(m.startswith("mpmd.recipes.") for m in c) and "mpmd.recipes.registry" in c for c in cycles), cycles
