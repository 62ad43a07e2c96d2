"""The instruction set a slice executes, as plain records.

A *plan* is one ordered instruction stream per slice. The runtime walks it without knowing
what a stage or a microbatch is: it runs programs on named buffers, moves buffers between
slices, and frees them. Every buffer is a *bundle*: a tuple of arrays (a flattened pytree),
so a program's inputs and outputs are bundles too.

Records are NamedTuples of str/int/tuples so a plan can be printed, diffed, validated and
sent over the wire as JSON (see `to_json` / `from_json`); nothing here is pickled. Long
plans are built, post-processed (Deletes, receive window) and shipped as arrays of
integers over templates of these records: runtime/worker/streams.py.
"""

from __future__ import annotations

from typing import NamedTuple, Union


class Spec(NamedTuple):
    """Shape, dtype and layout of one array in a bundle (dtype as a numpy name, e.g.
    'float32'). `layout` is a PartitionSpec as a tuple over the slice's mesh axes (one entry
    per dim: None, an axis name or a tuple of them; () is replicated)."""

    shape: tuple[int, ...]
    dtype: str
    layout: tuple = ()


class Run(NamedTuple):
    """Run `program` on the input bundles, bind its output bundles to `outputs`."""

    program: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    label: str = ""  # what a trace shows, e.g. "F s1 mb3"


class Send(NamedTuple):
    """Make `buffer` available to slice `dst` under `key`. Never blocks the sender.

    `pieces`: per array, into how many equal parts along axis 0 it crosses the wire (its
    batch shards on the sender; () or 1: whole). The matching Recv names the same."""

    buffer: str
    dst: int
    key: str
    pieces: tuple[int, ...] = ()


class Recv(NamedTuple):
    """Bind `buffer` to what slice `src` sends under `key`.

    Receives are posted ahead of need, so the transfer runs while the slice computes earlier
    instructions; the instruction itself only marks where the stream first needs the data.
    `post_after`: the index of the instruction after which the receive is posted (-1: when
    the step starts); runtime/worker/streams.py `with_recv_window` sets it to bound the receives
    outstanding at once.
    """

    buffer: str
    src: int
    key: str
    specs: tuple[Spec, ...]
    pieces: tuple[int, ...] = ()
    post_after: int = -1


class Delete(NamedTuple):
    """Free `buffer` (its last use has passed)."""

    buffer: str


class Copy(NamedTuple):
    """Bind `dst` to the arrays of `src`, in host memory (`memory="host"`: a snapshot that
    outlives later steps) or on the slice's devices ("device"). On CPU both are the same
    arrays: they are immutable and never donated, so a snapshot costs no copy there."""

    src: str
    dst: str
    memory: str = "device"


MEMORY_KINDS = ("device", "host")
Instruction = Union[Run, Send, Recv, Delete, Copy]
KINDS = {"run": Run, "send": Send, "recv": Recv, "delete": Delete, "copy": Copy}
_NAMES = {cls: name for name, cls in KINDS.items()}


def buffers_read(ins: Instruction) -> tuple[str, ...]:
    if isinstance(ins, Run):
        return ins.inputs
    if isinstance(ins, Send):
        return (ins.buffer,)
    if isinstance(ins, Copy):
        return (ins.src,)
    return ()


def buffers_written(ins: Instruction) -> tuple[str, ...]:
    if isinstance(ins, Run):
        return ins.outputs
    if isinstance(ins, Recv):
        return (ins.buffer,)
    if isinstance(ins, Copy):
        return (ins.dst,)
    return ()


def to_json(ins: Instruction) -> list:
    """[kind, field, ...] with tuples as lists: a stable, language-neutral wire form."""
    fields = list(ins)
    if isinstance(ins, Recv):
        fields[3] = [[list(s.shape), s.dtype] + ([layout_to_json(s.layout)] if s.layout else []) for s in ins.specs]
    return [_NAMES[type(ins)], *[list(f) if isinstance(f, tuple) else f for f in fields]]


def layout_to_json(layout: tuple) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in layout]


def layout_from_json(value) -> tuple:
    """A layout from its JSON form; ValueError unless every entry is null, a name or a list of names."""
    if not isinstance(value, list):
        raise ValueError(f"a layout must be a list, got {type(value).__name__}")
    out = []
    for e in value:
        if isinstance(e, list) and all(isinstance(n, str) for n in e):
            out.append(tuple(e))
        elif e is None or isinstance(e, str):
            out.append(e)
        else:
            raise ValueError(f"layout entry {e!r:.50} must be null, a mesh axis name or a list of them")
    return tuple(out)


def from_json(item: list) -> Instruction:
    """Inverse of `to_json`; raises ValueError naming what is malformed."""
    if not isinstance(item, list) or not item or item[0] not in KINDS:
        raise ValueError(f"instruction must be [kind, ...] with kind in {sorted(KINDS)}, got {item!r:.200}")
    cls = KINDS[item[0]]
    fields = item[1:]
    if not len(cls._fields) - len(cls._field_defaults) <= len(fields) <= len(cls._fields):
        raise ValueError(f"{item[0]} takes fields {cls._fields}, got {len(fields)} values")
    try:
        if cls is Run:
            program, inputs, outputs, *rest = fields
            ins = Run(_str(program), tuple(map(_str, inputs)), tuple(map(_str, outputs)), *map(_str, rest))
        elif cls is Send:
            ins = Send(_str(fields[0]), _int(fields[1]), _str(fields[2]), *map(_pieces, fields[3:]))
        elif cls is Recv:
            specs = tuple(Spec(tuple(map(_int, s[0])), _str(s[1]), *map(layout_from_json, s[2:3])) for s in fields[3])
            ins = Recv(
                _str(fields[0]),
                _int(fields[1]),
                _str(fields[2]),
                specs,
                *map(_pieces, fields[4:5]),
                *map(_int, fields[5:6]),
            )
        elif cls is Copy:
            ins = Copy(_str(fields[0]), _str(fields[1]), *map(_str, fields[2:]))
            if ins.memory not in MEMORY_KINDS:
                raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {ins.memory!r:.50}")
        else:
            ins = Delete(_str(fields[0]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"malformed {item[0]} instruction {item!r:.200}: {e}") from None
    return ins


def _pieces(x) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in x):
        raise TypeError(f"pieces must be a list of positive integers, got {x!r:.50}")
    return tuple(x)


def _str(x) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {type(x).__name__}")
    return x


def _int(x) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"expected an integer, got {type(x).__name__}")
    return x
