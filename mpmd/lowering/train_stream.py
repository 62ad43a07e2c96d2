"""One slice's training stream, computed with numpy from the schedule's task arrays: each
kind of task on each of the slice's stages emits a fixed pattern of rows (`_TrainRows`, one
method per part of the step: forward, input gradient, weight gradient, shared-weight
exchange, clipping norm, update), its microbatch filled in."""

from __future__ import annotations

import functools

import numpy as np

from mpmd.lowering.rows import J, K, Q, SCALAR, Rows, StageIO, Transfers, tiled, weight_total
from mpmd.runtime.worker.instructions import Recv, Run, Send
from mpmd.runtime.worker.streams import PackedStream
from mpmd.schedules import core as schedules
from mpmd.schedules.task_arrays import KIND_CODES, as_arrays
from mpmd.stages import names
from mpmd.stages.pipeline import shared_peers


def train_streams(
    schedule: schedules.Schedule,
    transfers: Transfers,
    clip: bool,
    shared: list[list[tuple[int, int]]] = (),
    shared_specs: dict | None = None,
    io: StageIO = StageIO(),
) -> list[PackedStream]:
    """One training step's instruction stream per slice, before Deletes are inserted: every
    slice's `train_stream`."""
    schedule = schedule._replace(slices=as_arrays(schedule.slices))  # converted once
    return [train_stream(schedule, r, transfers, clip, shared, shared_specs, io) for r in range(schedule.num_slices)]


def train_stream(
    schedule: schedules.Schedule,
    r: int,
    transfers: Transfers,
    clip: bool,
    shared: list[list[tuple[int, int]]] = (),
    shared_specs: dict | None = None,
    io: StageIO = StageIO(),
) -> PackedStream:
    """Slice r's instruction stream for one training step, before Deletes are inserted,
    encoded (runtime/worker/streams.py) and computed from the schedule's task arrays with numpy:
    each kind of task on each of the slice's stages emits a fixed pattern of rows, its
    microbatch filled in.

    `transfers` gives each receive's specs and each send's pieces (see Transfers; for plans
    without layouts, `Transfers.plain(act_specs)`). The streams name programs but do not
    need them, so a dry run can replay a schedule with synthetic programs of declared cost
    under the same names (mpmd/lowering/dryrun.py).

    `shared` groups (stage, leaf) pairs that are one parameter held by several stages (a tied
    embedding): once a stage's gradient is final it sends its shared leaves' gradients to
    the other holders, and before the update each holder sums every holder's part in stage
    order, so all copies get the same total gradient, bit for bit, and stay identical.
    """
    tasks = as_arrays(schedule.slices)
    a, b = int(tasks.offsets[r]), int(tasks.offsets[r + 1])
    stage, mb, kind = tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b]
    out = _TrainRows(
        schedule, r, transfers, clip, _peers(schedule.num_stages, tuple(map(tuple, shared))), shared_specs or {}, io
    )
    mine = out.stages
    local = np.full(schedule.num_stages, 0, np.int64)
    local[list(mine)] = np.arange(len(mine))
    # The first and the last gradient task of each stage: the first starts the gradient
    # buffer, after the last it is final.
    grad = kind == KIND_CODES[schedules.WEIGHT if schedule.split_backward else schedules.BACKWARD]
    first = np.zeros(len(stage), np.int64)
    patterns = [out.task(code, k, bool(f)) for code in range(len(KIND_CODES)) for k in mine for f in (0, 1)]
    rows_of = (kind.astype(np.int64) * len(mine) + local[stage]) * 2
    # Tasks of their own: what follows a stage's last gradient task, and (weights gathered
    # once a step) gather{k} before its first forward. (before which task, pattern)
    extra = []
    for k in mine:
        at = np.flatnonzero(grad & (stage == k))
        if len(at):
            first[at[0]] = 1
            extra.append((int(at[-1]) + 1, len(patterns)))
            patterns.append(out.gradient_final(k))
        forwards = np.flatnonzero((kind == KIND_CODES[schedules.FORWARD]) & (stage == k))
        if io.gathers(k) and len(forwards):
            extra.append((int(forwards[0]), len(patterns)))
            patterns.append(out.gather(k))
    rows_of += first
    if extra:
        where, which = zip(*extra)
        rows_of, mb = np.insert(rows_of, where, which), np.insert(mb, where, 0)
    return out.rows.encoded(out.head() + [tiled(patterns, rows_of, mb)] + out.tail())


class _TrainRows:
    """The row patterns of one slice's training stream: one method per part of the step
    (forward, input gradient, weight gradient, shared-weight exchange, clipping norm,
    update). A transfer is emitted only where producer and consumer sit on different slices."""

    def __init__(
        self,
        schedule: schedules.Schedule,
        r: int,
        transfers: Transfers,
        clip: bool,
        peers,
        shared_specs,
        io: StageIO = StageIO(),
    ):
        self.r, self.clip, self.peers, self.shared_specs, self.io = r, clip, peers, shared_specs, io
        self.num_microbatches = schedule.num_microbatches
        self.t = transfers
        self.placement = schedule.placement
        self.num_stages, self.num_slices = schedule.num_stages, schedule.num_slices
        self.split = schedule.split_backward
        self.stages = schedule.stages_on(r)
        self.rows = Rows()

    def _elsewhere(self, k: int) -> bool:
        return self.placement[k] != self.r

    def task(self, code: int, k: int, first: bool) -> list:
        """The rows of one task of kind `code` on stage k (`first`: the stage's first gradient task)."""
        if code == KIND_CODES[schedules.FORWARD]:
            return self.forward(k)
        if code == KIND_CODES[schedules.BACKWARD] and self.split:
            return self.input_grad(k)
        # a full backward (B without split) or a weight gradient (W)
        return self.weight_grad(k, code == KIND_CODES[schedules.BACKWARD], first)

    # -- before the first task ----------------------------------------------------------------
    def head(self) -> list[tuple[np.ndarray, ...]]:
        """A weighted loss: the last stage's slice sums the step's weights first (they read
        the batch only), so every backward can be seeded with 1/total."""
        last = self.num_stages - 1
        if not self.io.weighted or self._elsewhere(last):
            return []
        return [Rows.block([self.rows(weight_total(self.num_microbatches), last)])]

    # -- forward --------------------------------------------------------------------------
    def gather(self, k: int) -> list:
        """Before stage k's first forward: its weights gathered over fsdp for the step (pg{k},
        deleted by the slice after its last use, the stage's last gradient task)."""
        return [self.rows(Run(names.program("gather", K), (names.params(K),), (names.gathered(K),), f"gather s{K}"), k)]

    def forward(self, k: int) -> list:
        row, t, pl = self.rows, self.t, self.placement
        first, last = k == 0, k == self.num_stages - 1
        a_in = names.inputs(J) if first else names.activation(K, J)
        rows = []
        if not first and self._elsewhere(k - 1):
            rows.append(row(Recv(a_in, 0, names.act_key(K, J), t.acts_in[k], t.act_pieces[k]), k, 0, pl[k - 1]))
        out = names.loss(J) if last else names.activation(Q, J)
        fed = ((names.side(K, J),) if self.io.takes_side(k) else ()) + ((names.targets(J),) if last else ())
        aux = (names.aux(K, J),) if self.io.adds_aux(k) else ()
        # Stage state is read and written by each forward in turn, microbatch 0..m-1.
        state = (names.stage_state(K),) if self.io.carries_state(k) else ()
        rows.append(
            row(
                Run(
                    names.program("fwd", K),
                    (self.io.weights(k),) + state + (a_in,) + fed,
                    (out, names.residuals(K, J)) + state + aux,
                    f"F s{K} mb{J}",
                ),
                k,
                k + 1,
            )
        )
        if not last and self._elsewhere(k + 1):
            rows.append(row(Send(out, 0, names.act_key(Q, J), t.act_pieces[k + 1]), k, k + 1, pl[k + 1]))
        return rows

    # -- backward -------------------------------------------------------------------------
    def _backward_inputs(self, k: int, receive: bool, rows: list) -> tuple[str, ...]:
        """(params, residuals[, cotangent of the output]); receives the cotangent once, at
        the task that first needs it (B, not W)."""
        if k == self.num_stages - 1:  # the loss: its cotangent is 1/m, or 1/total weight
            return (self.io.weights(k), names.residuals(K, J)) + ((names.weight_sum(),) if self.io.weighted else ())
        d = names.cotangent(K, J)
        if receive and self._elsewhere(k + 1):
            rows.append(
                self.rows(
                    Recv(d, 0, names.grad_key(K, J), self.t.cts_in[k], self.t.ct_pieces[k]), k, 0, self.placement[k + 1]
                )
            )
        return self.io.weights(k), names.residuals(K, J), d

    def _send_input_grad(self, k: int, rows: list) -> None:
        if k > 0 and self._elsewhere(k - 1):
            rows.append(
                self.rows(
                    Send(names.cotangent(Q, J), 0, names.grad_key(Q, J), self.t.ct_pieces[k - 1]),
                    k,
                    k - 1,
                    self.placement[k - 1],
                )
            )

    def input_grad(self, k: int) -> list:
        """Zero-bubble B: the input gradient, and what W needs of B's work, kept until W
        (none for the first stage: its input is data)."""
        rows = []
        base = self._backward_inputs(k, True, rows)
        if k > 0:
            rows.append(
                self.rows(
                    Run(names.program("bwd_in", K), base, (names.cotangent(Q, J), names.kept(K, J)), f"B s{K} mb{J}"),
                    k,
                    k - 1,
                )
            )
            self._send_input_grad(k, rows)
        return rows

    def weight_grad(self, k: int, input_grad_too: bool, first: bool) -> list:
        """Accumulate stage k's weight gradient for a microbatch (W), or with input_grad_too
        the full backward (B of a schedule without split backward)."""
        rows = []
        base = self._backward_inputs(k, input_grad_too, rows)
        if self.split and k > 0:
            base += (names.kept(K, J),)
        g = names.grads(K)
        acc = () if first else (g,)
        kind = ("bwd_w_" if self.split else "bwd_") + ("first" if first else "acc")
        dx = (names.cotangent(Q, J),) if input_grad_too and k > 0 else ()
        label = f"{'B' if input_grad_too else 'W'} s{K} mb{J}"
        rows.append(self.rows(Run(names.program(kind, K), base + acc, dx + (g,), label), k, k - 1))
        if input_grad_too:
            self._send_input_grad(k, rows)
        return rows

    def gradient_final(self, k: int) -> tuple[np.ndarray, ...]:
        """The rows after stage k's last gradient task: its one reduction over the batch axes
        when its gradient accumulated unreduced, then what follows a final gradient."""
        final = self._gradient_final(k)
        if not self.io.reduces(k):
            return final
        reduce = Rows.block(
            [self.rows(Run(names.program("reduce", K), (names.grads(K),), (names.grads(K),), f"reduce s{K}"), k)]
        )
        return tuple(np.concatenate(c) for c in zip(reduce, final))

    def _gradient_final(self, k: int) -> tuple[np.ndarray, ...]:
        if self.peers[k]:
            # Offer the shared part to the other holders; the norm waits for their parts.
            rows = [
                self.rows(
                    Run(names.program("shared_out", K), (names.grads(K),), (names.shared(K),), f"shared out s{K}"), k
                )
            ]
            rows += [
                self.rows(
                    Send(names.shared(K), 0, names.shared_key(K, Q), self.shared_specs[(k, q)][1]),
                    k,
                    q,
                    self.placement[q],
                )
                for q in self.peers[k]
                if self._elsewhere(q)
            ]
            return Rows.block(rows)
        if self.clip:
            # Final, and nothing to add to it: start the norm exchange now so it overlaps
            # with the slice's remaining tasks.
            return self._send_norm(k)
        return Rows.block([])

    # -- after the last task ------------------------------------------------------------------
    def tail(self) -> list[tuple[np.ndarray, ...]]:
        return self.sum_shared() + self.receive_norms() + [self.update()]

    def sum_shared(self) -> list[tuple[np.ndarray, ...]]:
        """Each holder of a shared parameter sums every holder's part, in stage order."""
        blocks = []
        for k in self.stages:
            if not self.peers[k]:
                continue
            rows = [
                self.rows(
                    Recv(names.shared(Q), 0, names.shared_key(Q, K), *self.shared_specs[(q, k)]),
                    k,
                    q,
                    self.placement[q],
                )
                for q in self.peers[k]
                if self._elsewhere(q)
            ]  # a local peer's part is its own buffer
            parts = tuple(names.shared(q) for q in sorted(self.peers[k] + [k]))
            rows.append(
                self.rows(
                    Run(
                        names.program("shared_in", K), (names.grads(K),) + parts, (names.grads(K),), f"shared sum s{K}"
                    ),
                    k,
                )
            )
            blocks.append(Rows.block(rows))
            if self.clip:
                blocks.append(self._send_norm(k))
        return blocks

    def _send_norm(self, k: int) -> tuple[np.ndarray, ...]:
        """Stage k's squared gradient norm, to every other slice (each computes the global norm)."""
        run = self.rows(Run(names.program("sqnorm", K), (names.grads(K),), (names.sqnorm(K),), f"norm s{K}"), k)
        send = self.rows(Send(names.sqnorm(K), 0, names.sqnorm_key(K, Q)), k)[0]
        others = np.delete(np.arange(self.num_slices, dtype=np.int32), self.r)
        n = len(others) + 1
        return (
            np.concatenate(([run[0]], np.full(n - 1, send))),
            np.full(n, k, np.int32),
            np.zeros(n, np.int32),
            np.concatenate(([0], others)),
            np.concatenate(([0], others)),
        )

    def receive_norms(self) -> list[tuple[np.ndarray, ...]]:
        if not self.clip:
            return []
        placement = np.asarray(self.placement, dtype=np.int32)
        ks = np.flatnonzero(placement != self.r).astype(np.int32)
        op = self.rows(Recv(names.sqnorm(K), 0, names.sqnorm_key(K, Q), SCALAR), 0)[0]
        n = len(ks)
        return [(np.full(n, op, np.int32), ks, np.zeros(n, np.int32), np.full(n, self.r, np.int32), placement[ks])]

    def update(self) -> tuple[np.ndarray, ...]:
        sq = _sqnorms(self.num_stages) if self.clip else ()
        state = (names.params(K), names.opt_state(K))
        return Rows.block(
            [
                self.rows(Run(names.program("update", K), state + (names.grads(K),) + sq, state, f"U s{K}"), k)
                for k in self.stages
            ]
        )


@functools.lru_cache(maxsize=4)
def _peers(num_stages: int, shared: tuple) -> list[list[int]]:
    """pipeline.shared_peers, once per pipeline rather than once per slice."""
    return shared_peers(num_stages, shared)


@functools.lru_cache(maxsize=4)
def _sqnorms(num_stages: int) -> tuple[str, ...]:
    """Every stage's squared-norm buffer, the update's inputs when clipping (one tuple for
    all slices)."""
    return tuple(names.sqnorm(i) for i in range(num_stages))
