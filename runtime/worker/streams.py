"""Instruction streams as arrays: a few instruction templates and one row of integers per
instruction, so a plan of 100,000s of instructions per slice costs ~24 bytes an
instruction, is built and post-processed with numpy, and travels as compact bytes.

A *template* is an instruction (runtime/worker/instructions.py) whose strings may name the integer
fields {k}, {j} and {q}. Row i of a `PackedStream` is template `op[i]` with those fields
set to `k[i]`, `j[i]`, `q[i]`, `peer[i]` as a Send's dst or a Recv's src, and `post[i]` as a
Recv's post_after. What the fields mean is the producer's business (mpmd/ uses stage,
microbatch and a second stage or slice); the runtime only formats them.

`with_deletes` and `with_recv_window` work on this form directly. A stream may also carry
them as still to do (`finishing(keep, window)`): the controller then ships only the rows
it computed and each worker derives its own Deletes and receive marks, the same way, for
its slice alone. A worker receives the bytes (`to_bytes`), checks them (`from_bytes`:
ValueError naming what is malformed) and expands them into instruction records once, when
the plan is installed. A `PackedStream` also reads as the sequence of its final instructions
(len, indexing, iterating, ==), expanded on demand.
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections.abc import Sequence

import numpy as np

from mpmd.runtime.worker.instructions import (
    Copy,
    Delete,
    Instruction,
    Recv,
    Run,
    Send,
    buffers_read,
    buffers_written,
    from_json,
    to_json,
)

FIELDS = ("k", "j", "q")
COLUMNS = ("op", "k", "j", "q", "peer", "post")
_MAGIC = b"MPMDSTR1"
_ROW_BYTES = 4 * len(COLUMNS)


def template_fields(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(literal pieces, field names) of a template string; ValueError unless every field is
    a bare {k}, {j} or {q} (no attribute, index, conversion or format spec)."""
    literals, fields = [""], []  # literals[i] comes before fields[i]; one more than fields
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise ValueError(f"template {text!r:.80} is malformed: {e}") from None
    for literal, field, spec, conversion in parsed:
        literals[-1] += literal
        if field is None:
            continue
        if field not in FIELDS or spec or conversion:
            raise ValueError(
                f"template {text!r:.80} names field {{{field}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}}; allowed: {{k}}, {{j}}, {{q}}"
            )
        fields.append(field)
        literals.append("")
    return tuple(literals), tuple(fields)


def _strings(t: Instruction) -> list[str]:
    """Every string field of a template (the ones that may name fields)."""
    if isinstance(t, Run):
        return [t.program, *t.inputs, *t.outputs, t.label]
    if isinstance(t, (Send, Recv)):
        return [t.buffer, t.key]
    if isinstance(t, Copy):
        return [t.src, t.dst]
    return [t.buffer]


def _maker(t: Instruction):
    """A function (fields dict, peer, post) -> the instruction template `t` makes."""
    f = lambda s: (lambda v: s.format_map(v)) if "{" in s else (lambda v: s)
    if isinstance(t, Run):
        prog, ins, outs, label = f(t.program), [f(s) for s in t.inputs], [f(s) for s in t.outputs], f(t.label)
        return lambda v, peer, post: Run(prog(v), tuple(g(v) for g in ins), tuple(g(v) for g in outs), label(v))
    if isinstance(t, Send):
        buf, key = f(t.buffer), f(t.key)
        return lambda v, peer, post: Send(buf(v), peer, key(v), t.pieces)
    if isinstance(t, Recv):
        buf, key = f(t.buffer), f(t.key)
        return lambda v, peer, post: Recv(buf(v), peer, key(v), t.specs, t.pieces, post)
    if isinstance(t, Copy):
        src, dst = f(t.src), f(t.dst)
        return lambda v, peer, post: Copy(src(v), dst(v), t.memory)
    buf = f(t.buffer)
    return lambda v, peer, post: Delete(buf(v))


class PackedStream(Sequence):
    """One stream: `templates` and int32 columns op, k, j, q, peer, post (one entry per
    row), and what is still to do to its rows: Deletes for every buffer not in `keep`
    (None: none to add) and receive marks for `window` (None: leave them)."""

    __slots__ = ("templates", "op", "k", "j", "q", "peer", "post", "keep", "window", "_final")

    def __init__(self, templates, op, k, j, q, peer, post, keep=None, window=None):
        self.templates = tuple(templates)
        self.op, self.k, self.j, self.q, self.peer, self.post = (
            np.asarray(c, dtype=np.int32) for c in (op, k, j, q, peer, post)
        )
        assert all(len(c) == len(self.op) for c in (self.k, self.j, self.q, self.peer, self.post))
        self.keep = tuple(sorted(keep)) if keep is not None else None
        self.window = _check_window(window) if window is not None else None
        self._final = None

    def finishing(self, keep, window: int | None = None) -> "PackedStream":
        """These rows, with `with_deletes(keep)` then `with_recv_window(window)` left to
        whoever reads the instructions (a worker, for its own slice)."""
        return PackedStream(self.templates, *self.columns(), keep=keep, window=window)

    def final(self) -> "PackedStream":
        """The stream with what is still to do done (itself if nothing is)."""
        if self.keep is None and self.window is None:
            return self
        if self._final is None:
            done = PackedStream(self.templates, *self.columns())
            if self.keep is not None:
                done = with_deletes(done, self.keep)
            if self.window is not None:
                done = with_recv_window(done, self.window)
            self._final = done
        return self._final

    @staticmethod
    def from_instructions(stream) -> "PackedStream":
        """Any instruction list, one template per distinct instruction (strings escaped)."""
        esc = lambda s: s.replace("{", "{{").replace("}", "}}")
        ids: dict = {}
        rows = []
        for ins in stream:
            peer = ins.dst if isinstance(ins, Send) else ins.src if isinstance(ins, Recv) else 0
            post = ins.post_after if isinstance(ins, Recv) else -1
            if isinstance(ins, Run):
                t = Run(esc(ins.program), tuple(map(esc, ins.inputs)), tuple(map(esc, ins.outputs)), esc(ins.label))
            elif isinstance(ins, Send):
                t = Send(esc(ins.buffer), 0, esc(ins.key), ins.pieces)
            elif isinstance(ins, Recv):
                t = Recv(esc(ins.buffer), 0, esc(ins.key), ins.specs, ins.pieces)
            elif isinstance(ins, Copy):
                t = Copy(esc(ins.src), esc(ins.dst), ins.memory)
            else:
                t = Delete(esc(ins.buffer))
            rows.append((ids.setdefault(t, len(ids)), peer, post))
        cols = np.array(rows, dtype=np.int32).reshape(-1, 3).T
        zero = np.zeros(len(rows), np.int32)
        return PackedStream(list(ids), cols[0], zero, zero, zero, cols[1], cols[2])

    # -- reading as instructions -------------------------------------------------------------
    def expand(self, rows=None) -> list[Instruction]:
        """The final instructions (see `final`), all or those at `rows`."""
        done = self.final()
        makers = [_maker(t) for t in done.templates]
        rows = range(len(done)) if rows is None else rows
        op, k, j, q, peer, post = (c.tolist() for c in done.columns())
        return [makers[op[i]]({"k": k[i], "j": j[i], "q": q[i]}, peer[i], post[i]) for i in rows]

    def columns(self) -> tuple[np.ndarray, ...]:
        """The rows as they are (before what is still to do)."""
        return self.op, self.k, self.j, self.q, self.peer, self.post

    def __len__(self) -> int:
        return len(self.final().op)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.expand(range(*i.indices(len(self))))
        return self.expand([range(len(self))[i]])[0]

    def __iter__(self):
        return iter(self.expand())

    def __eq__(self, other) -> bool:
        if isinstance(other, (PackedStream, list, tuple)):
            return len(self) == len(other) and self.expand() == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"PackedStream({len(self.op)} rows, {len(self.templates)} templates, keep={self.keep}, window={self.window})"

    # -- whole-stream edits ------------------------------------------------------------------
    def with_templates(self, fn) -> "PackedStream":
        """The same rows over templates `fn(template)` (e.g. programs renamed), still to be
        finished the same way."""
        return PackedStream([fn(t) for t in self.templates], *self.columns(), keep=self.keep, window=self.window)

    def select(self, rows: np.ndarray) -> "PackedStream":
        """The rows a boolean mask or index array picks, in order (of a stream with nothing
        still to do: row indices would change under it)."""
        assert self.keep is None and self.window is None, "select before finishing"
        return PackedStream(self.templates, *(c[rows] for c in self.columns()))

    def template_mask(self, predicate) -> np.ndarray:
        """Per row: whether `predicate(instruction)` holds for an instruction its template makes
        (fields 0), e.g. to drop every row of some kinds of program."""
        hit = np.array(
            [bool(predicate(_maker(t)(dict.fromkeys(FIELDS, 0), 0, -1))) for t in self.templates] + [False], dtype=bool
        )
        return hit[self.op]

    # -- the wire ---------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Magic, header length, JSON header (the templates), then the columns as int32 rows."""
        rest = json.dumps(
            {"rows": len(self.op), "keep": None if self.keep is None else list(self.keep), "window": self.window},
            separators=(",", ":"),
        )
        header = ('{"templates":[' + ",".join(map(_template_json, self.templates)) + "]," + rest[1:]).encode()
        body = b"".join(c.astype("<i4", copy=False).tobytes() for c in self.columns())
        return _MAGIC + len(header).to_bytes(8, "little") + header + body


@functools.lru_cache(maxsize=1 << 12)
def _template_json(template: Instruction) -> str:
    """A template's JSON, once per template (an update's names every stage's norm: the same
    long template for every slice)."""
    return json.dumps(to_json(template), separators=(",", ":"))


def from_bytes(data: bytes) -> PackedStream:
    """Inverse of `PackedStream.to_bytes`, checked: ValueError naming what is malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:8]) != _MAGIC or len(data) < 16:
        raise ValueError(f"an encoded instruction stream must start with the magic {_MAGIC!r} and a header length")
    size = int.from_bytes(data[8:16], "little")
    if 16 + size > len(data):
        raise ValueError(f"encoded stream header of {size} bytes runs past the payload ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[16 : 16 + size]))
    except ValueError as e:
        raise ValueError(f"encoded stream header is not JSON: {e}") from None
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("templates"), list)
        or not isinstance(header.get("rows"), int)
        or header["rows"] < 0
    ):
        raise ValueError("encoded stream header must be {\"templates\": [...], \"rows\": n >= 0}")
    keep, window = header.get("keep"), header.get("window")
    if keep is not None and not (isinstance(keep, list) and all(isinstance(x, str) for x in keep)):
        raise ValueError(f"encoded stream 'keep' must be null or a list of buffer name templates, got {keep!r:.100}")
    for x in keep or ():
        template_fields(x)
    if window is not None:
        _check_window(window)
    templates = [from_json(t) for t in header["templates"]]
    for n, t in enumerate(templates):
        for s in _strings(t):
            try:
                template_fields(s)
            except ValueError as e:
                raise ValueError(f"template {n}: {e}") from None
    rows = header["rows"]
    body = memoryview(data)[16 + size :]
    if len(body) != rows * _ROW_BYTES:
        raise ValueError(f"encoded stream of {rows} rows needs {rows * _ROW_BYTES} bytes of columns, got {len(body)}")
    cols = np.frombuffer(body, dtype="<i4").reshape(len(COLUMNS), rows).astype(np.int32)
    op, k, j, q, peer, post = cols
    if rows and not (op.min() >= 0 and op.max() < len(templates)):
        raise ValueError(
            f"encoded stream row {int(np.flatnonzero((op < 0) | (op >= len(templates)))[0])} "
            f"names a template outside 0..{len(templates) - 1}"
        )
    for name, c in (("k", k), ("j", j), ("q", q)):
        if rows and c.min() < 0:
            raise ValueError(
                f"encoded stream row {int(np.argmax(c < 0))}: field {name} must be >= 0, got {int(c.min())}"
            )
    moves = np.array([isinstance(t, (Send, Recv)) for t in templates] + [False], dtype=bool)[op]
    if np.any(moves & (peer < 0)):
        raise ValueError(
            f"encoded stream row {int(np.argmax(moves & (peer < 0)))}: a send or receive needs a peer slice >= 0"
        )
    if window is None:
        # Marks already made must point back into the stream (the executor refuses them
        # too, but here the message names the row).
        recv = np.array([isinstance(t, Recv) for t in templates] + [False], dtype=bool)[op]
        bad = recv & ((post < -1) | (post >= np.arange(rows)))
        if np.any(bad):
            raise ValueError(
                f"encoded stream row {int(np.argmax(bad))}: a receive posted after row "
                f"{int(post[np.argmax(bad)])}; allowed: -1 (at the start) to the row before it"
            )
    return PackedStream(templates, op, k, j, q, peer, post, keep=keep, window=window)


def _check_window(window) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(
            f"the receive window must be a positive integer (receives outstanding at once), got {window!r}"
        )
    return window


def as_packed(stream) -> PackedStream:
    return stream if isinstance(stream, PackedStream) else PackedStream.from_instructions(stream)


# -- post-processing, on the arrays ----------------------------------------------------------
def with_deletes(stream, keep) -> PackedStream:
    """`stream` with a Delete after the last read or write of every buffer not in `keep`
    (a buffer written and never read is freed at once).

    `keep` names the buffers that outlive the step; an entry with fields (e.g. "p{k}")
    keeps every buffer of that form, one without keeps that one name. A buffer is known by
    its name's literal pieces and numbers, wherever they come from: "a{k}/{j}" with k=1,
    "a{q}/{j}" with q=1 and the literal "a1/{j}" name one family at the same values. So a
    field is never next to another field or a digit, and a number never has a leading zero
    (mpmd/stages/names.py's names keep to that). The Deletes after one instruction come in the
    order of its outputs, then its inputs.
    """
    enc = as_packed(stream).final()
    n = len(enc.op)
    slots = [buffers_written(t) + buffers_read(t) for t in enc.templates]
    width = max([len(x) for x in slots] + [1])
    cols = enc.columns()
    # Per buffer family: the occurrences (row * width + slot), their (template, slot) pair,
    # and the numbers that tell the family's buffers apart.
    patterns: dict[tuple, list] = {}
    for entry in keep:
        literals, sources = _canonical(entry)
        patterns.setdefault(literals, []).append(tuple(None if isinstance(x, int) else x[0] for x in sources))
    kept_whole = {lits for lits, ps in patterns.items() if any(all(v is None for v in p) for p in ps)}
    found: dict[tuple, list] = {}
    pairs: list[tuple[int, int]] = []
    for t in np.flatnonzero(np.bincount(enc.op, minlength=len(slots))).tolist():
        rows = np.flatnonzero(enc.op == t)
        with_fields, written_out = _slot_plan(enc.templates[t])
        for s, literals, sources in with_fields:
            if literals in kept_whole:
                continue
            values = np.empty((len(sources), len(rows)), np.int32)
            for i, src in enumerate(sources):
                values[i] = cols[src][rows] if isinstance(src, int) else src[0]
            found.setdefault(literals, []).append((rows * width + s, np.full(len(rows), len(pairs), np.int64), values))
            pairs.append((t, s))
        for literals, at, values in written_out:  # all of a family's written-out names at once
            if literals in kept_whole:
                continue
            ids = np.arange(len(pairs), len(pairs) + len(at), dtype=np.int64)
            found.setdefault(literals, []).append(
                ((rows[:, None] * width + at).ravel(), np.tile(ids, len(rows)), np.tile(values, (1, len(rows))))
            )
            pairs += [(t, s) for s in at.tolist()]
    flats, pair_ids = [], []
    for literals, parts in found.items():
        flat = np.concatenate([f for f, _, _ in parts])
        pair = np.concatenate([p for _, p, _ in parts])
        values = np.concatenate([v for _, _, v in parts], axis=1)
        key, size, encode = _dense_key(values)
        last = np.full(size, -1, np.int64)
        np.maximum.at(last, key, flat)
        final = last[key] == flat
        exact = [pattern for pattern in patterns.get(literals, ()) if None not in pattern]
        if exact:
            kept = encode(np.array(exact, np.int64).reshape(len(exact), -1).T)
            final &= ~np.isin(key, kept)
        for pattern in patterns.get(literals, ()):
            if None in pattern:  # every buffer that agrees where the entry has numbers
                hit = np.ones(len(flat), bool)
                for i, v in enumerate(pattern):
                    if v is not None:
                        hit &= values[i] == v
                final &= ~hit
        flats.append(flat[final])
        pair_ids.append(pair[final])
    # In row order, then slot order: one sort of (occurrence, pair) packed in an integer.
    both = (
        np.sort(np.concatenate(flats) * (len(pairs) + 1) + np.concatenate(pair_ids)) if flats else np.zeros(0, np.int64)
    )
    pair = both % (len(pairs) + 1)
    after = both // (len(pairs) + 1) // width
    # A Delete template per (template, slot) that frees something: the slot's own text,
    # formatted with the fields of the row that used the buffer last.
    templates = list(enc.templates)
    ids = {t: i for i, t in enumerate(templates)}
    delete_op = np.full(len(pairs) + 1, -1, np.int32)
    for p in np.flatnonzero(np.bincount(pair, minlength=len(pairs))).tolist():
        t, s = pairs[p]
        delete_op[p] = ids.setdefault(Delete(slots[t][s]), len(ids))
    before = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(after, minlength=n)[:n], out=before[1:])
    out = np.empty((len(COLUMNS), n + len(after)), np.int32)
    old = np.arange(n) + before[:n]
    at = after + 1 + np.arange(len(after))
    for c, column in enumerate(cols):
        out[c][old] = column
        out[c][at] = delete_op[pair] if c == 0 else column[after] if c < 4 else 0 if c == 4 else -1
    return PackedStream(list(ids), *out)


@functools.lru_cache(maxsize=1 << 12)
def _slot_plan(template: Instruction):
    """The buffers a template names, by family (see `_canonical`): [(slot, literal pieces,
    sources)] for names with fields, and per family of written-out names (e.g. an update's
    "sq0".."sq2047") (literal pieces, their slots, their numbers as a (numbers, slots) array)."""
    with_fields, written_out = [], {}
    for s, text in enumerate(buffers_written(template) + buffers_read(template)):
        literals, sources = _canonical(text)
        if any(isinstance(src, int) for src in sources):
            with_fields.append((s, literals, sources))
        else:
            written_out.setdefault(literals, []).append((s, [src[0] for src in sources]))
    return with_fields, [
        (
            literals,
            np.array([s for s, _ in group], np.int64),
            np.array([v for _, v in group], np.int64).reshape(len(group), -1).T,
        )
        for literals, group in written_out.items()
    ]


@functools.lru_cache(maxsize=1 << 16)
def _canonical(text: str) -> tuple[tuple[str, ...], tuple]:
    """A buffer name template as (literal pieces, source of each number between them): a
    column index (1 k, 2 j, 3 q) for a field, (value,) for digits written out."""
    literals, fields = template_fields(text)
    pieces, sources = [], []
    current = ""
    for i, literal in enumerate(literals):
        split = _NUMBER.split(literal)  # text, number, text, ...
        current += split[0]
        for number, rest in zip(split[1::2], split[2::2]):
            pieces.append(current)
            sources.append((int(number),))
            current = rest
        if i < len(fields):
            pieces.append(current)
            sources.append(1 + FIELDS.index(fields[i]))
            current = ""
    pieces.append(current)
    return tuple(pieces), tuple(sources)


_NUMBER = re.compile(r"(?<!\d)(0|[1-9]\d*)(?!\d)")


def _dense_key(values: np.ndarray):
    """Dense integer keys of value tuples (columns of `values`), each field compacted to the
    values it takes: (keys, key space size, encode(other tuples) -> their keys, -1 where a
    tuple holds a value never seen)."""
    nf, count = values.shape
    key = np.zeros(count, np.int64)
    size, codes = 1, []
    for i in range(nf):
        v = values[i]
        present = np.zeros(int(v.max()) + 1 if count else 1, bool)
        present[v] = True
        code = np.cumsum(present, dtype=np.int32) - 1
        codes.append((present, code))
        span = int(code[-1] + 1)
        key = key * span + (code[v] if span < len(present) else v)  # no gaps: the value is its code
        size *= span

    def encode(other: np.ndarray) -> np.ndarray:
        k = np.zeros(other.shape[1], np.int64)
        seen = np.ones(other.shape[1], bool)
        for i, (present, code) in enumerate(codes):
            v = np.clip(other[i], 0, len(present) - 1)
            seen &= (other[i] == v) & present[v]
            k = k * int(code[-1] + 1) + code[v]
        return np.where(seen, k, -1)

    return key, size, encode


def with_recv_window(stream, window: int) -> PackedStream:
    """`stream` with each receive posted only once the one `window` receives before it has
    been walked: at most `window` receives are outstanding (posted, not yet reached), so the
    memory a slice holds for received data it has not used is bounded by `window` bundles,
    while each transfer still overlaps the instructions between its post and its use.
    Apply last: the marks are row indices."""
    _check_window(window)
    enc = as_packed(stream).final()
    recv = np.array([isinstance(t, Recv) for t in enc.templates] + [False], dtype=bool)
    at = np.flatnonzero(recv[enc.op])
    post = enc.post.copy()
    post[at[:window]] = -1
    if len(at) > window:
        post[at[window:]] = at[: len(at) - window]
    return PackedStream(enc.templates, enc.op, enc.k, enc.j, enc.q, enc.peer, post)
