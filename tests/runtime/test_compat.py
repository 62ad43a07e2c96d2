"""mpmd.runtime.compat: the JAX versions a controller and its workers agree on, and the jaxpr
spelling that differs across the supported range (what this machine's jax runs; the branches
for jax >= 0.11 are checked against that release's source, docs/design.md)."""
import jax
import jax.numpy as jnp
import pytest

from mpmd.runtime import compat
from tests.support.processes import ROOT, TINY_GPT

OTHER = {"jax": "0.11.2", "jaxlib": "0.11.2"}


def test_versions_are_what_this_process_runs():
    import jaxlib
    assert compat.versions() == {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    compat.check_versions(compat.versions())       # the same: no error


def test_other_versions_are_refused_naming_both_sides():
    with pytest.raises(compat.VersionMismatch) as e:
        compat.check_versions(OTHER)
    line = str(e.value)
    assert "\n" not in line
    assert f"jax {jax.__version__}, jaxlib {compat.versions()['jaxlib']}" in line and "jax 0.11.2, jaxlib 0.11.2" in line
    with pytest.raises(compat.VersionMismatch, match="unknown versions"):
        compat.check_versions({"jax": 11})


def test_new_jaxpr_keeps_constvars_apart_from_invars():
    # A jaxpr with a constant: the spelling that changed in jax 0.11 (constvars without their
    # consts would become invars there).
    c = jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda x: x * c + 1.0)(jnp.ones(3))
    jaxpr, consts = compat.closed_parts(closed)
    assert len(consts) == 1 and len(jaxpr.constvars) == 1
    rebuilt = compat.new_jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, jaxpr.eqns, jaxpr.effects,
                               jaxpr.debug_info, consts)
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
    from mpmd.recipes import train_cli
    monkeypatch.setattr(compat, "versions", lambda: dict(OTHER))
    status = train_cli.main([str(ROOT / "configs/gpt_tiny.yaml"), f"run_dir={tmp_path / 'run'}", "train.steps=1",
                             *TINY_GPT])
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: worker ") and "(slice " in err
    assert f"this worker runs jax {jax.__version__}" in err and "its controller runs jax 0.11.2, jaxlib 0.11.2" in err
