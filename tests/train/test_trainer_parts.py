"""The Trainer is parts with their own state (mpmd/train/): no part reaches into another's
underscored attributes, and its options arrive as records checked once (mpmd.Checkpointing,
mpmd.Recovery)."""

import ast
import inspect
from pathlib import Path

import optax
import pytest

import mpmd
from mpmd.train.dispatch import StepEvents
from mpmd.train.relayout import RecoveryPolicy
from tests.support.recovery_runs import make_pipe

TRAIN = Path(__file__).resolve().parents[2] / "mpmd" / "train"
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public, despite the underscore


def private_reaches(source: str) -> list[str]:
    """Every `x._name` whose `x` is not `self` or `cls` (a NamedTuple's own API aside), every
    getattr(x, "_name") and every `from ... import _name` in `source`, as "line: text"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not own and node.attr not in NAMEDTUPLE_API:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            found += [
                f"{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_check_finds_a_part_reaching_into_another():
    source = (
        "class Relayout:\n"
        "    def move(self, t):\n"
        "        t._step = 0\n"
        "        self._own = t.public\n"
        "        getattr(t, '_compiled')\n"
        "        row = row._replace(program='x')\n"
        "from mpmd.train.dispatch import _split\n"
    )
    assert private_reaches(source) == [
        "3: t._step",
        "5: getattr(t, '_compiled')",
        "7: from mpmd.train.dispatch import _split",
    ]


@pytest.mark.parametrize("path", sorted(TRAIN.glob("*.py")), ids=lambda p: p.name)
def test_no_part_touches_another_parts_private_state(path):
    assert private_reaches(path.read_text()) == [], (
        f"{path.name} reaches into another object's private state: give the owner a public method or property instead"
    )


def test_no_file_of_the_trainer_is_past_600_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in TRAIN.glob("*.py")}
    assert max(sizes.values()) <= 600, sizes


@pytest.mark.parametrize(
    "kw, allowed",
    [
        (dict(checkpoint={"every": 2}), "checkpoint must be an mpmd.Checkpointing"),
        (dict(checkpoint=mpmd.Recovery()), "checkpoint must be an mpmd.Checkpointing"),
        (dict(recovery="shrink"), "recovery must be an mpmd.Recovery"),
        (dict(recovery=mpmd.Checkpointing()), "recovery must be an mpmd.Recovery"),
    ],
)
def test_a_non_record_option_is_a_value_error_naming_the_record(kw, allowed):
    with pytest.raises(ValueError, match=allowed):
        mpmd.Trainer(make_pipe(), optax.sgd(0.1), num_microbatches=2, **kw)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: mpmd.Checkpointing(every=-1), "every must be a non-negative integer"),
        (lambda: mpmd.Checkpointing(keep=0), "keep must be a positive integer"),
        (lambda: mpmd.Checkpointing(asynchronous=1), "asynchronous must be True or False"),
        (lambda: mpmd.Checkpointing(max_failed_saves=-1), "max_failed_saves must be a non-negative integer"),
        (lambda: mpmd.Checkpointing(memory_every=True), "memory_every must be a non-negative integer"),
        (lambda: mpmd.Checkpointing(metadata=[1]), "metadata must be a dict"),
        (lambda: mpmd.Recovery(max_restarts=-1), "max_restarts must be a non-negative integer"),
        (lambda: mpmd.Recovery(restart_window_s=0), "restart_window_s must be a finite number of seconds > 0"),
        (lambda: mpmd.Recovery(restart_window_s=float("inf")), "restart_window_s must be a finite number"),
        (lambda: mpmd.Mesh(fsdp_gather="once"), r"fsdp_gather must be one of \['per_microbatch', 'per_step'\]"),
        (lambda: mpmd.Mesh(rules=[("embed", None)]), "rules must be a dict of logical axis"),
        (lambda: mpmd.Mesh("data"), "mesh shape must be None, a dict of axis sizes"),
    ],
)
def test_records_check_their_fields_when_made(make, says):
    with pytest.raises(ValueError, match=says):
        make()


def test_periodic_checkpoints_need_a_run_dir():
    with pytest.raises(ValueError, match=r"Checkpointing\(every=2\) needs run_dir"):
        mpmd.Trainer(make_pipe(), optax.sgd(0.1), num_microbatches=2, checkpoint=mpmd.Checkpointing(every=2))


def test_everything_after_the_optimizer_is_a_keyword():
    with pytest.raises(TypeError, match="positional"):
        mpmd.Trainer(make_pipe(), optax.sgd(0.1), "1f1b", 2)


def test_the_dispatcher_tells_the_recovery_policy_through_step_events():
    """The dispatcher has no callbacks into the Trainer: what becomes of a step goes to one
    StepEvents object, the recovery policy, whose methods take what the protocol's do."""
    with mpmd.Trainer(make_pipe(), optax.sgd(0.1), num_microbatches=2) as trainer:
        assert trainer.dispatcher.events is trainer.recovery
    for name in ("collected", "lost", "nonfinite"):
        want = inspect.signature(getattr(StepEvents, name))
        got = inspect.signature(getattr(RecoveryPolicy, name))
        assert list(got.parameters) == list(want.parameters), name
