"""Import structure: the schedule tools load without JAX, the package's public names load
lazily, and mpmd's modules import in any order (their imports form a DAG)."""

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
        ("split", "mpmd.stages.split"),
        ("stage_boundary", "mpmd.stages.marks"),
        ("tune", "mpmd.tuner.core"),
        ("Rewound", "mpmd.train.checkpoints"),
        ("InProcessCluster", "mpmd.runtime.control.inprocess"),
        ("LocalCluster", "mpmd.runtime.launchers.local"),
        ("RayCluster", "mpmd.runtime.launchers.ray"),
        ("StaticCluster", "mpmd.runtime.launchers.static"),
        ("WorkerLost", "mpmd.runtime.control.cluster"),
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
