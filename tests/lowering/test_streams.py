"""PackedStream instruction streams (runtime/worker/streams.py) and the array lowering (mpmd/lowering/core.py):
the same instructions as the object lowering they replaced (tests/support/lowering_reference.py),
for every schedule, and a wire form that a worker checks before it expands anything."""

import itertools
import json

import numpy as np
import pytest

from mpmd.lowering import core as lowering
from mpmd.stages import names
from mpmd.schedules import core as schedules
from mpmd.runtime.worker import streams
from mpmd.runtime.worker.instructions import Delete, Recv, Run, Send, Spec
from tests.support import lowering_reference as reference

ACT = (Spec((2, 3), "float32", ("data",)),)


def _canonical(stream) -> list:
    """Instructions with each run of consecutive Deletes sorted: the order in which buffers
    are freed at one point of the walk is not part of a plan's meaning (the reference
    sorts them by name, the encoded form by the instruction's outputs then inputs)."""
    out, run = [], []
    for ins in list(stream) + [None]:
        if isinstance(ins, Delete):
            run.append(ins)
            continue
        out += sorted(run)
        run = []
        if ins is not None:
            out.append(ins)
    return out


CASES = [
    ("gpipe", 3, 5, 1),
    ("1f1b", 4, 6, 1),
    ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 3, 6, 2),
    ("zb-h1", 3, 4, 1),
    ("zb-v", 2, 4, 2),
    ("zb-v", 3, 8, 2),
    ("dualpipe-v", 2, 8, 2),
    ("dualpipe-v", 4, 8, 2),
]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_encoded_lowering_equals_the_object_lowering(name, p, m, v):
    schedule = schedules.make(name, p * v, m, v)
    S = schedule.num_stages
    transfers = lowering.Transfers([ACT] * S + [()], [()] + [(2,)] * S, [ACT] * S, [(2,)] * (S - 1) + [()])
    persistent = {names.params(k) for k in range(S)} | {names.opt_state(k) for k in range(S)}
    windows = lowering.recv_windows(schedule)
    for clip, tied in itertools.product((False, True), (False, True)):
        shared = [[(0, 0), (S - 1, 0)]] if tied else []
        parts = {(0, S - 1): (ACT, (2,)), (S - 1, 0): (ACT, (2,))} if tied else {}
        expected = reference.train_streams(schedule, transfers, clip, shared, parts)
        got = lowering.train_streams(schedule, transfers, clip, shared, parts)
        assert [list(s) for s in got] == expected, (name, clip, tied)
        for r, (want, have) in enumerate(zip(expected, got)):
            keep = persistent | {names.loss(j) for j in range(m)}
            want = reference.with_recv_window(reference.with_deletes(want, keep), windows[r])
            # Kept by template (every loss) and by exact names: the same plan.
            for kept in ({"p{k}", "o{k}", "loss/{j}"}, keep):
                finished = have.finishing(kept, windows[r])
                assert _canonical(finished) == _canonical(want), (name, clip, tied, r)
                assert list(streams.from_bytes(finished.to_bytes())) == list(finished)
    evaluate, predict = lowering._forward_only(schedule, transfers)
    want_eval, want_predict = reference._forward_only(schedule, transfers)
    assert [list(s) for s in evaluate] == want_eval and [list(s) for s in predict] == want_predict


def test_deletes_know_a_buffer_by_its_numbers_whatever_names_it():
    # Written through field q, read through k, and once as a written-out name: one buffer.
    t = [Run("f{k}", ("x/{j}",), ("a{q}/{j}",)), Run("g{k}", ("a{k}/{j}",), ("y{k}",)), Run("h", ("a1/0", "y1"), ())]
    enc = streams.PackedStream(t, [0, 1, 0, 1, 2], [0, 1, 0, 1, 0], [0, 0, 1, 1, 0], [1, 0, 1, 0, 0], [0] * 5, [-1] * 5)
    done = list(streams.with_deletes(enc, {"y{k}"}))
    assert done == [
        Run("f0", ("x/0",), ("a1/0",)),
        Delete("x/0"),
        Run("g1", ("a1/0",), ("y1",)),
        Run("f0", ("x/1",), ("a1/1",)),
        Delete("x/1"),
        Run("g1", ("a1/1",), ("y1",)),
        Delete("a1/1"),
        Run("h", ("a1/0", "y1"), ()),
        Delete("a1/0"),
    ]
    assert list(streams.with_deletes(enc, {"y1", "a1/0"}))[-1] == Run("h", ("a1/0", "y1"), ())


def test_an_encoded_plan_reads_as_instructions_and_renames():
    enc = lowering.train_streams(schedules.make("1f1b", 2, 2), lowering.Transfers.plain([ACT] * 3), False)[1]
    done = enc.finishing({"p{k}", "o{k}", "loss/{j}"}, 1)
    assert len(done) == len(list(done)) > len(enc.op)
    assert done[0] == list(done)[0] and done[-2:] == list(done)[-2:]
    renamed = done.with_templates(lambda t: t._replace(program=t.program + "@1") if isinstance(t, Run) else t)
    assert [i.program for i in renamed if isinstance(i, Run)] == [i.program + "@1" for i in done if isinstance(i, Run)]
    assert (renamed.keep, renamed.window) == (done.keep, done.window)
    # A window wider than the stream's receives: every receive posted at the start.
    wide = enc.finishing({"p{k}"}, 1000)
    assert {i.post_after for i in wide if isinstance(i, Recv)} == {-1}


def _payload(templates, rows, columns=None) -> bytes:
    return streams.PackedStream(templates, *(columns or [[0] * rows] * 4 + [[1] * rows, [-1] * rows])).to_bytes()


def _raw(header: dict, rows: int = 0) -> bytes:
    """A payload with this header and `rows` zero rows."""
    head = json.dumps(header).encode()
    return streams._MAGIC + len(head).to_bytes(8, "little") + head + bytes(24 * rows)


RUN = ["run", "f", [], []]


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"junk", "must start with the magic"),
        (streams._MAGIC + (10**6).to_bytes(8, "little") + b"{}", "runs past the payload"),
        (streams._MAGIC + (2).to_bytes(8, "little") + b"[]", "header must be"),
        (_payload([Run("f{k.__class__}", (), ())], 1), r"names field \{k.__class__\}; allowed"),
        (_payload([Run("f{k:>9}", (), ())], 1), "names field"),
        (_payload([Run("f{", (), ())], 1), "malformed"),
        (_payload([Send("a{k}", 0, "act{k}")], 1)[:-4], "needs 24 bytes of columns, got 20"),
        (
            _payload([Run("f", (), ())], 2, [[0, 1], [0, 0], [0, 0], [0, 0], [0, 0], [-1, -1]]),
            "row 1 names a template outside 0..0",
        ),
        (_payload([Run("f{j}", (), ())], 1, [[0], [0], [-3], [0], [0], [-1]]), "field j must be >= 0"),
        (_payload([Send("a", 0, "act")], 1, [[0], [0], [0], [0], [-1], [-1]]), "needs a peer slice >= 0"),
        (_payload([Recv("a", 0, "k", ACT)], 1, [[0], [0], [0], [0], [1], [0]]), "posted after row 0"),
        (_raw({"templates": [RUN], "rows": 1, "window": 0}, 1), "receive window must be a positive"),
        (_raw({"templates": [RUN], "rows": 1, "keep": [3]}, 1), "'keep' must be null or a list"),
        (_raw({"templates": [RUN], "rows": 1, "keep": ["p{k!r}"]}, 1), "names field"),
        (_raw({"templates": [["jump"]], "rows": 0}), "kind in"),
        (_raw({"templates": [RUN], "rows": -1}), "header must be"),
    ],
)
def test_a_malformed_encoded_stream_is_refused_naming_what(payload, match):
    with pytest.raises(ValueError, match=match):
        streams.from_bytes(payload)


def test_an_encoded_stream_survives_the_wire_bit_for_bit():
    schedule = schedules.make("zb-v", 4, 4)
    enc = lowering.train_streams(
        schedule, lowering.Transfers.plain([ACT] * 5), True, [[(0, 0), (3, 0)]], {(0, 3): (ACT, ()), (3, 0): (ACT, ())}
    )[0].finishing({"p{k}", "o{k}"}, 2)
    back = streams.from_bytes(enc.to_bytes())
    assert back.templates == enc.templates and (back.keep, back.window) == (enc.keep, enc.window)
    assert all(np.array_equal(a, b) for a, b in zip(back.columns(), enc.columns()))
    assert list(back) == list(enc)
