"""mpmd.runtime.compat: the JAX versions a controller and its workers agree on, and what is
spelt differently across the supported range. Each test runs the branch of the version this
process runs; CI runs the suite on jax 0.10.2, 0.11.2 and 0.12.x (.ci/run), so every branch
is exercised on the version it serves."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpmd.runtime import compat
from tests.support.processes import ROOT, TINY_GPT, StandaloneWorkers

pytestmark = pytest.mark.every_jax  # what each JAX version is told and refused

# The Python of another venv with mpmd installed on other JAX versions (.ci/run sets it on the
# newer side to the Python 3.11 venv of jax 0.10.2), whose workers this process's controller
# must refuse.
OTHER_PYTHON = os.environ.get("MPMD_OTHER_PYTHON")

# Versions no side of CI runs (below the supported range), so they differ from this process's.
OTHER = {"jax": "0.9.2", "jaxlib": "0.9.2"}


def test_versions_are_what_this_process_runs():
    import jaxlib

    assert compat.versions() == {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    compat.check_versions(compat.versions())  # the same: no error


def test_other_versions_are_refused_naming_both_sides():
    with pytest.raises(compat.VersionMismatch) as e:
        compat.check_versions(OTHER)
    line = str(e.value)
    assert "\n" not in line
    assert f"jax {jax.__version__}, jaxlib {compat.versions()['jaxlib']}" in line and "jax 0.9.2, jaxlib 0.9.2" in line
    with pytest.raises(compat.VersionMismatch, match="unknown versions"):
        compat.check_versions({"jax": 11})


def test_new_jaxpr_keeps_constvars_apart_from_invars():
    # A jaxpr with a constant: the spelling that changed in jax 0.11 (constvars without their
    # consts would become invars there).
    c = jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda x: x * c + 1.0)(jnp.ones(3))
    jaxpr, consts = compat.closed_parts(closed)
    assert len(consts) == 1 and len(jaxpr.constvars) == 1
    rebuilt = compat.new_jaxpr(
        jaxpr.constvars, jaxpr.invars, jaxpr.outvars, jaxpr.eqns, jaxpr.effects, jaxpr.debug_info, consts
    )
    assert rebuilt.constvars == jaxpr.constvars and rebuilt.invars == jaxpr.invars
    (out,) = jax.core.eval_jaxpr(rebuilt, consts, jnp.full(3, 2.0))
    assert out.tolist() == [1.0, 3.0, 5.0]


def test_a_nested_call_is_one_of_the_call_primitives():
    closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x))(1.0)
    assert [e.primitive.name for e in closed.jaxpr.eqns] == ["jit"]
    assert "jit" in compat.CALL_PRIMITIVES
    body, consts = compat.closed_parts(closed.jaxpr.eqns[0].params["jaxpr"])
    assert [e.primitive.name for e in body.eqns] == ["sin"] and consts == []


@pytest.mark.slow
def test_a_worker_on_other_versions_is_refused_at_setup(monkeypatch, capsys, tmp_path):
    # The controller (this process) says it runs other versions; the workers are real
    # processes on this machine's JAX, so each refuses Setup and `mpmd train` ends in one line.
    from mpmd.recipes.commands import train as train_cli

    monkeypatch.setattr(compat, "versions", lambda: dict(OTHER))
    status = train_cli.main(
        [str(ROOT / "configs/gpt_tiny.yaml"), f"run_dir={tmp_path / 'run'}", "train.steps=1", *TINY_GPT]
    )
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: worker ") and "(slice " in err
    assert f"this worker runs jax {jax.__version__}" in err and "its controller runs jax 0.9.2, jaxlib 0.9.2" in err


def test_meshes_are_built_with_auto_axes():
    # From jax 0.11 an AbstractMesh defaults to Explicit axes and a Mesh over devices to Auto;
    # a program exported for the one then refuses to run on the other.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    assert compat.abstract_mesh((1, 2), ("a", "b")).axis_types == (AxisType.Auto, AxisType.Auto)
    mesh = compat.mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("a", "b"))
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    # Exported for the abstract mesh, called on the concrete one: what a worker's load does.
    sharding = NamedSharding(compat.abstract_mesh((1, 2), ("a", "b")), PartitionSpec(None, "b"))
    arg = jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=sharding)
    exported = jax.export.export(jax.jit(lambda x: x * 2.0, out_shardings=sharding))(arg)
    x = jax.device_put(jnp.arange(8.0).reshape(2, 4), NamedSharding(mesh, PartitionSpec(None, "b")))
    assert exported.call(x).tolist() == (jnp.arange(8.0).reshape(2, 4) * 2.0).tolist()


def test_compile_fast_flags_are_ones_this_xla_knows():
    # XLA aborts a process whose XLA_FLAGS name a flag it does not know; jaxlib 0.11 removed
    # --xla_cpu_use_fusion_emitters.
    env = dict(os.environ, XLA_FLAGS=compat.XLA_CPU_COMPILE_FAST, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.numpy.ones(3).sum())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr[-500:]
    assert ("--xla_cpu_use_fusion_emitters=false" in compat.XLA_CPU_COMPILE_FAST) == (compat.JAXLIB_VERSION < (0, 11))


@pytest.mark.slow
@pytest.mark.skipif(
    not OTHER_PYTHON,
    reason="MPMD_OTHER_PYTHON names no Python of a venv on other JAX versions (.ci/run sets it on the newer side)",
)
def test_a_worker_of_another_venv_is_refused_naming_both_versions(tmp_path, capsys):
    # Two real venvs: workers started by hand on the other venv's Python (other jax and
    # jaxlib), this process's controller on its own; `mpmd train` ends in one line at Setup.
    from mpmd.recipes.commands import train as train_cli

    probe = "import json; from mpmd.runtime import compat; print(json.dumps(compat.versions()))"
    theirs = json.loads(
        subprocess.run([OTHER_PYTHON, "-c", probe], capture_output=True, text=True, check=True, timeout=120).stdout
    )
    assert theirs != compat.versions(), f"MPMD_OTHER_PYTHON runs this process's versions too: {theirs}"
    with StandaloneWorkers(tmp_path, 2, shared=False, python=OTHER_PYTHON) as workers:
        status = train_cli.main(
            [
                str(ROOT / "configs/gpt_tiny.yaml"),
                f"run_dir={workers.root / 'run'}",
                "train.steps=1",
                "cluster.backend=static",
                f"cluster.addresses={json.dumps(workers.addresses)}",
                f"cluster.token_file={tmp_path / 'token'}",
                *TINY_GPT,
            ]
        )
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1, err
    assert f"this worker runs jax {theirs['jax']}, jaxlib {theirs['jaxlib']}" in err, err
    mine = compat.versions()
    assert f"its controller runs jax {mine['jax']}, jaxlib {mine['jaxlib']}" in err, err
