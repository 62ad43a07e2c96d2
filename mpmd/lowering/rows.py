"""The parts every instruction stream of a step is made of: what a transfer names and cuts
(Transfers), what a stage takes and gives beyond activations (StageIO), and the row encoding
both the training stream (mpmd/lowering/train_stream.py) and the forward-only streams
(mpmd/lowering/core.py) emit: templates with fields {k} {j} {q}, one row of integers per
instruction (runtime/worker/streams.py)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpmd.runtime.worker.instructions import Run, Spec
from mpmd.runtime.worker.streams import PackedStream
from mpmd.stages import names

SCALAR = (Spec((), "float32"),)


class Transfers(NamedTuple):
    """The specs a receive names and the pieces a send cuts, per kind of transfer. Index k:
    acts_in[k] / act_pieces[k]: the activation entering stage k (on k's slice / as k-1's slice
    cuts it); cts_in[k] / ct_pieces[k]: the gradient of stage k's output (on k's slice / as
    k+1's slice cuts it)."""

    acts_in: list
    act_pieces: list
    cts_in: list
    ct_pieces: list

    @staticmethod
    def plain(act_specs: list[tuple[Spec, ...]]) -> "Transfers":
        """Whole arrays, as received (act_specs[k]: the bundle entering stage k; k =
        num_stages: the last output)."""
        return Transfers(list(act_specs), [()] * len(act_specs), list(act_specs[1:]), [()] * (len(act_specs) - 1))


class StageIO(NamedTuple):
    """What a stage's programs take and give beyond activations (mpmd/stages/batch.py): per
    stage whether it is fed side inputs and whether it adds auxiliary losses, and whether the
    loss is weighted (the last slice first sums the step's weights). The defaults: none."""

    side: tuple = ()
    aux: tuple = ()
    weighted: bool = False
    state: tuple = ()  # per stage: whether it carries stage state (st{k})
    partial: tuple = ()  # per stage: its gradients accumulate unreduced (mpmd/stages/partials.py)
    gather: tuple = ()  # per stage: gather{k} makes pg{k} once a step (mpmd/stages/gather.py)

    def takes_side(self, k: int) -> bool:
        return bool(self.side) and self.side[k]

    def adds_aux(self, k: int) -> bool:
        return bool(self.aux) and self.aux[k]

    def carries_state(self, k: int) -> bool:
        return bool(self.state) and self.state[k]

    def reduces(self, k: int) -> bool:
        """Whether stage k's gradient is reduced once, by reduce{k} after its last gradient task."""
        return bool(self.partial) and self.partial[k]

    def gathers(self, k: int) -> bool:
        """Whether stage k's forward and backward programs take pg{k}, its weights gathered
        over fsdp by gather{k} before its first forward."""
        return bool(self.gather) and self.gather[k]

    def weights(self, k: int) -> str:
        """The buffer stage k's training programs take its parameters from, as a row template
        (its stage field {k})."""
        return names.gathered(K) if self.gathers(k) else names.params(K)


# Template fields (runtime/worker/streams.py): k the task's stage, j its microbatch, q the other
# stage a row names (k + 1 for what F sends, k - 1 for what B sends) or a destination.
K, J, Q = "{k}", "{j}", "{q}"


class Rows:
    """One slice's templates (deduplicated) and rows as (template id, k, q, peer) tuples or
    blocks of arrays; every name comes from mpmd/stages/names.py with fields for k, j, q."""

    def __init__(self):
        self.ids: dict = {}

    def __call__(self, template, k: int, q: int = 0, peer: int = 0) -> tuple[int, int, int, int]:
        return self.ids.setdefault(template, len(self.ids)), k, max(q, 0), peer

    @staticmethod
    def block(rows, j=0) -> tuple[np.ndarray, ...]:
        """(op, k, j, q, peer) arrays of `rows` (each (id, k, q, peer)), microbatch j."""
        a = np.array(rows, dtype=np.int32).reshape(-1, 4).T
        return a[0], a[1], np.full(len(rows), j, np.int32), a[2], a[3]

    def encoded(self, blocks) -> PackedStream:
        cols = [np.concatenate([b[c] for b in blocks]) if blocks else np.zeros(0, np.int32) for c in range(5)]
        return PackedStream(list(self.ids), *cols, np.full(len(cols[0]), -1, np.int32))


def tiled(patterns: list, rows_of: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, ...]:
    """The rows of a sequence of tasks: task t emits `patterns[rows_of[t]]`, rows of fixed
    (op, k, q, peer) (a list of tuples or a block of arrays), its microbatch j[t] filled in.
    Gathered from a (pattern, position) table, so the cost is a few passes over the rows."""
    width = max([len(p[0]) if isinstance(p, tuple) else len(p) for p in patterns] + [1])
    table = np.zeros((4, len(patterns), width), np.int32)
    lengths = np.zeros(len(patterns), np.int64)
    for c, p in enumerate(patterns):
        if isinstance(p, tuple):  # a block: (op, k, j, q, peer)
            cols = np.stack([p[0], p[1], p[3], p[4]]) if len(p[0]) else np.zeros((4, 0), np.int32)
        else:
            cols = np.array(p, dtype=np.int32).reshape(-1, 4).T
        table[:, c, : cols.shape[1]] = cols
        lengths[c] = cols.shape[1]
    per_task = lengths[rows_of]
    starts = np.cumsum(per_task) - per_task
    # Per row: its place in the table, pattern * width + position in the pattern.
    at = np.repeat(rows_of * width - starts, per_task) + np.arange(int(per_task.sum()))
    op, k, q, peer = (np.take(table[i].ravel(), at) for i in range(4))
    return op, k, np.repeat(j.astype(np.int32), per_task), q, peer


def weight_total(m: int) -> Run:
    """The last stage's sum of a weighted loss's weights over the step's m microbatches (its
    row's stage field fills {k})."""
    return Run(
        names.program("weight", K), tuple(names.targets(j) for j in range(m)), (names.weight_sum(),), f"weight s{K}"
    )
