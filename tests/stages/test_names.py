"""One name for each buffer, transfer key and program: built and parsed in mpmd/stages/names.py."""

import pytest

from mpmd.lowering import core as lowering
from mpmd.stages import names
from mpmd.schedules import core as schedules
from mpmd.runtime.worker.instructions import Recv, Run, Send, Spec


@pytest.mark.parametrize(
    "make,parsed",
    [
        (lambda: names.params(3), ("params", 3, None, None)),
        (lambda: names.opt_state(0), ("opt_state", 0, None, None)),
        (lambda: names.grads(12), ("grads", 12, None, None)),
        (lambda: names.sqnorm(2), ("sqnorm", 2, None, None)),
        (lambda: names.shared(1), ("shared", 1, None, None)),
        (lambda: names.inputs(7), ("input", None, 7, None)),
        (lambda: names.targets(7), ("target", None, 7, None)),
        (lambda: names.loss(5), ("loss", None, 5, None)),
        (lambda: names.output(5), ("output", None, 5, None)),
        (lambda: names.activation(2, 9), ("activation", 2, 9, None)),
        (lambda: names.residuals(2, 9), ("residuals", 2, 9, None)),
        (lambda: names.cotangent(10, 11), ("cotangent", 10, 11, None)),
    ],
)
def test_buffer_names_round_trip(make, parsed):
    name = make()
    assert tuple(names.parse_buffer(name))[:4] == parsed
    kind, stage, mb, _ = parsed
    fields = {"k": stage, "j": mb}
    assert names.BUFFERS[kind].format(**{f: v for f, v in fields.items() if v is not None}) == name


def test_keys_and_programs_round_trip():
    assert names.parse_key(names.act_key(2, 5)) == names.Name("act", 2, 5)
    assert names.parse_key(names.grad_key(1, 3)) == names.Name("grad", 1, 3)
    assert names.parse_key(names.sqnorm_key(0, 1)) == names.Name("sqnorm_to", 0, to=1)
    assert names.parse_key(names.shared_key(3, 0)) == names.Name("shared_to", 3, to=0)
    for kind in names.PROGRAMS:
        assert names.parse_program(names.program(kind, 4)) == names.Name(kind, 4)
        assert names.parse_program(names.program(kind, 4) + names.variant(2)) == names.Name(kind, 4, variant="@2")
    # The longest kind wins: "bwd_w_first1" is never "bwd" of something.
    assert names.parse_program("bwd_w_first1").kind == "bwd_w_first"
    assert names.stage_dir(3) == "stage_3"


@pytest.mark.parametrize("bad", ["p", "px", "a1", "a1/", "x/-1", "loss/1/2", "act1/2", "p1 ", ""])
def test_malformed_buffer_names_are_refused(bad):
    with pytest.raises(ValueError, match="is not a pipeline buffer name"):
        names.parse_buffer(bad)


@pytest.mark.parametrize("bad", ["fwd", "fwdx", "bogus3", "fwd1@", "update1@x"])
def test_malformed_program_names_are_refused(bad):
    with pytest.raises(ValueError, match="is not a pipeline program name"):
        names.parse_program(bad)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 4, 1), ("zb-h1", 3, 4, 1), ("interleaved-1f1b", 2, 4, 2)])
def test_every_name_a_lowered_plan_uses_parses(name, p, m, v):
    schedule = schedules.make(name, p * v, m, v)
    S = schedule.num_stages
    shared = [[(0, 0), (S - 1, 0)]]
    act = [(Spec((2,), "float32"),)] * (S + 1)
    parts = {(0, S - 1): (act[0], ()), (S - 1, 0): (act[0], ())}  # (sender, receiver) -> specs, pieces
    streams = lowering.train_streams(schedule, lowering.Transfers.plain(act), True, shared, parts)
    seen = set()
    for stream in streams:
        for ins in stream:
            if isinstance(ins, Run):
                seen.add(names.parse_program(ins.program).kind)
                for buffer in ins.inputs + ins.outputs:
                    seen.add(names.parse_buffer(buffer).kind)
            elif isinstance(ins, (Send, Recv)):
                seen.add(names.parse_key(ins.key).kind)
                seen.add(names.parse_buffer(ins.buffer).kind)
    assert {
        "fwd",
        "update",
        "sqnorm",
        "shared_out",
        "shared_in",
        "act",
        "grad",
        "sqnorm_to",
        "shared_to",
        "activation",
        "cotangent",
        "residuals",
        "grads",
    } <= seen
