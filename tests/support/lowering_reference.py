"""The lowering as it was before streams became arrays: one Python object per
instruction, emitted task by task, and Deletes and receive marks inserted on instruction
lists. mpmd.lowering.core and mpmd.runtime.worker.streams must give the same instructions
(tests/lowering/test_streams.py compares them); nothing outside the tests uses this."""

from __future__ import annotations

import numpy as np

from mpmd.stages import names
from mpmd.schedules import core as schedules
from mpmd.lowering.core import SCALAR, Transfers
from mpmd.stages.pipeline import shared_peers
from mpmd.schedules.task_arrays import KIND_CODES, as_arrays
from mpmd.runtime.worker.instructions import Delete, Instruction, Recv, Run, Send, buffers_read, buffers_written


def train_streams(
    schedule: schedules.Schedule,
    transfers: Transfers,
    clip: bool,
    shared: list[list[tuple[int, int]]] = (),
    shared_specs: dict | None = None,
) -> list[list[Instruction]]:
    """One training step's instruction stream per slice, before Deletes are inserted."""
    schedule = schedule._replace(slices=as_arrays(schedule.slices))  # converted once
    return [train_stream(schedule, r, transfers, clip, shared, shared_specs) for r in range(schedule.num_slices)]


def train_stream(
    schedule: schedules.Schedule,
    r: int,
    transfers: Transfers,
    clip: bool,
    shared: list[list[tuple[int, int]]] = (),
    shared_specs: dict | None = None,
) -> list[Instruction]:
    """Slice r's training stream, task by task (see mpmd.lowering.core.train_stream)."""
    tasks = as_arrays(schedule.slices)
    a, b = int(tasks.offsets[r]), int(tasks.offsets[r + 1])
    stage, mb, kind = tasks.stage[a:b], tasks.microbatch[a:b], tasks.kind[a:b]
    peers = shared_peers(schedule.num_stages, shared)
    out = _TrainStream(schedule, r, transfers, clip, peers, shared_specs or {}, stage, kind)
    forward, backward = KIND_CODES[schedules.FORWARD], KIND_CODES[schedules.BACKWARD]
    for k, j, code in zip(stage.tolist(), mb.tolist(), kind.tolist()):
        if code == forward:
            out.forward(k, j)
        elif code == backward and schedule.split_backward:
            out.input_grad(k, j)
        else:  # a full backward (B without split) or a weight gradient (W)
            out.weight_grad(k, j, input_grad_too=code == backward)
    out.sum_shared()
    out.receive_norms()
    out.update()
    return out.ops


class _TrainStream:
    """Emits one slice's training stream. Buffers are named by mpmd/stages/names.py; a transfer is
    emitted only where producer and consumer sit on different slices."""

    def __init__(
        self, schedule: schedules.Schedule, r: int, transfers: Transfers, clip: bool, peers, shared_specs, stage, kind
    ):
        self.r, self.clip, self.peers, self.shared_specs = r, clip, peers, shared_specs
        self.t = transfers
        self.placement = schedule.placement
        self.num_stages, self.num_slices = schedule.num_stages, schedule.num_slices
        self.split = schedule.split_backward
        self.ops: list[Instruction] = []
        self.stages = schedule.stages_on(r)
        # Weight-gradient tasks left per stage; at 0 the stage's gradient is final.
        last = stage[kind == KIND_CODES[schedules.WEIGHT if self.split else schedules.BACKWARD]]
        self.remaining = {k: int(np.count_nonzero(last == k)) for k in self.stages}
        self.accumulating: set[int] = set()  # stages whose gradient buffer exists

    def _elsewhere(self, k: int) -> bool:
        return self.placement[k] != self.r

    # -- forward --------------------------------------------------------------------------
    def forward(self, k: int, j: int) -> None:
        first, last = k == 0, k == self.num_stages - 1
        a_in = names.inputs(j) if first else names.activation(k, j)
        if not first and self._elsewhere(k - 1):
            self.ops.append(
                Recv(a_in, self.placement[k - 1], names.act_key(k, j), self.t.acts_in[k], self.t.act_pieces[k])
            )
        out = names.loss(j) if last else names.activation(k + 1, j)
        targets = (names.targets(j),) if last else ()
        self.ops.append(
            Run(
                names.program("fwd", k),
                (names.params(k), a_in) + targets,
                (out, names.residuals(k, j)),
                f"F s{k} mb{j}",
            )
        )
        if not last and self._elsewhere(k + 1):
            self.ops.append(Send(out, self.placement[k + 1], names.act_key(k + 1, j), self.t.act_pieces[k + 1]))

    # -- backward -------------------------------------------------------------------------
    def _backward_inputs(self, k: int, j: int, receive: bool) -> tuple[str, ...]:
        """(params, residuals[, cotangent of the output]); receives the cotangent once, at
        the task that first needs it (B, not W)."""
        if k == self.num_stages - 1:  # the loss: its cotangent is the constant 1/m
            return names.params(k), names.residuals(k, j)
        d = names.cotangent(k, j)
        if receive and self._elsewhere(k + 1):
            self.ops.append(Recv(d, self.placement[k + 1], names.grad_key(k, j), self.t.cts_in[k], self.t.ct_pieces[k]))
        return names.params(k), names.residuals(k, j), d

    def _send_input_grad(self, k: int, j: int) -> None:
        if k > 0 and self._elsewhere(k - 1):
            self.ops.append(
                Send(
                    names.cotangent(k - 1, j), self.placement[k - 1], names.grad_key(k - 1, j), self.t.ct_pieces[k - 1]
                )
            )

    def input_grad(self, k: int, j: int) -> None:
        """Zero-bubble B: the input gradient, and what W needs of B's work, kept until W
        (none for the first stage: its input is data)."""
        base = self._backward_inputs(k, j, receive=True)
        if k > 0:
            self.ops.append(
                Run(names.program("bwd_in", k), base, (names.cotangent(k - 1, j), names.kept(k, j)), f"B s{k} mb{j}")
            )
            self._send_input_grad(k, j)

    def weight_grad(self, k: int, j: int, input_grad_too: bool) -> None:
        """Accumulate stage k's weight gradient for microbatch j (W), or with input_grad_too
        the full backward (B of a schedule without split backward)."""
        base = self._backward_inputs(k, j, receive=input_grad_too)
        if self.split and k > 0:
            base += (names.kept(k, j),)
        g = names.grads(k)
        acc = (g,) if k in self.accumulating else ()
        kind = ("bwd_w_" if self.split else "bwd_") + ("acc" if acc else "first")
        dx = (names.cotangent(k - 1, j),) if input_grad_too and k > 0 else ()
        label = f"{'B' if input_grad_too else 'W'} s{k} mb{j}"
        self.ops.append(Run(names.program(kind, k), base + acc, dx + (g,), label))
        self.accumulating.add(k)
        if input_grad_too:
            self._send_input_grad(k, j)
        self.remaining[k] -= 1
        if self.remaining[k] == 0:
            self._gradient_final(k)

    def _gradient_final(self, k: int) -> None:
        if self.peers[k]:
            # Offer the shared part to the other holders; the norm waits for their parts.
            self.ops.append(
                Run(names.program("shared_out", k), (names.grads(k),), (names.shared(k),), f"shared out s{k}")
            )
            self.ops.extend(
                Send(names.shared(k), self.placement[q], names.shared_key(k, q), self.shared_specs[(k, q)][1])
                for q in self.peers[k]
                if self._elsewhere(q)
            )
        elif self.clip:
            # Final, and nothing to add to it: start the norm exchange now so it overlaps
            # with the slice's remaining tasks.
            self._send_norm(k)

    # -- after the last task ------------------------------------------------------------------
    def sum_shared(self) -> None:
        """Each holder of a shared parameter sums every holder's part, in stage order."""
        for k in self.stages:
            if not self.peers[k]:
                continue
            for q in self.peers[k]:
                if self._elsewhere(q):  # a local peer's part is its own buffer: no transfer
                    self.ops.append(
                        Recv(names.shared(q), self.placement[q], names.shared_key(q, k), *self.shared_specs[(q, k)])
                    )
            parts = tuple(names.shared(q) for q in sorted(self.peers[k] + [k]))
            self.ops.append(
                Run(names.program("shared_in", k), (names.grads(k),) + parts, (names.grads(k),), f"shared sum s{k}")
            )
            if self.clip:
                self._send_norm(k)

    def _send_norm(self, k: int) -> None:
        """Stage k's squared gradient norm, to every other slice (each computes the global norm)."""
        sq = names.sqnorm(k)
        self.ops.append(Run(names.program("sqnorm", k), (names.grads(k),), (sq,), f"norm s{k}"))
        self.ops.extend(Send(sq, q, names.sqnorm_key(k, q)) for q in range(self.num_slices) if q != self.r)

    def receive_norms(self) -> None:
        if self.clip:
            self.ops.extend(
                Recv(names.sqnorm(k), self.placement[k], names.sqnorm_key(k, self.r), SCALAR)
                for k in range(self.num_stages)
                if self._elsewhere(k)
            )

    def update(self) -> None:
        sq = tuple(names.sqnorm(i) for i in range(self.num_stages)) if self.clip else ()
        for k in self.stages:
            state = (names.params(k), names.opt_state(k))
            self.ops.append(Run(names.program("update", k), state + (names.grads(k),) + sq, state, f"U s{k}"))


def _forward_only(schedule: schedules.Schedule, transfers: Transfers):
    """Evaluation and prediction plans, every slice's `forward_only_stream`."""
    plans = [forward_only_stream(schedule, r, transfers) for r in range(schedule.num_slices)]
    return [e for e, _ in plans], [p for _, p in plans]


def forward_only_stream(schedule: schedules.Schedule, r: int, transfers: Transfers):
    """Slice r's evaluation and prediction streams: F tasks only, in (microbatch, stage) order.

    Every dependency F(k-1, j) -> F(k, j) goes forward in that one global order, so no slice
    can wait on a task that waits on it: deadlock-free for any placement.
    """
    S, placement = schedule.num_stages, schedule.placement
    evaluate: list[Instruction] = []
    predict: list[Instruction] = []
    mine = schedule.stages_on(r)
    for j in range(schedule.num_microbatches):
        for k in mine:
            a_in = names.inputs(j) if k == 0 else names.activation(k, j)
            out = names.output(j) if k == S - 1 else names.activation(k + 1, j)
            ops: list[Instruction] = []
            if k > 0 and placement[k - 1] != r:
                ops.append(
                    Recv(a_in, placement[k - 1], names.act_key(k, j), transfers.acts_in[k], transfers.act_pieces[k])
                )
            ops.append(Run(names.program("infer", k), (names.params(k), a_in), (out,), f"F s{k} mb{j}"))
            if k < S - 1 and placement[k + 1] != r:
                ops.append(Send(out, placement[k + 1], names.act_key(k + 1, j), transfers.act_pieces[k + 1]))
            evaluate += ops
            predict += ops
            if k == S - 1:
                evaluate.append(Run(names.program("loss", k), (out, names.targets(j)), (names.loss(j),), f"loss mb{j}"))
    return evaluate, predict


def with_deletes(stream: list[Instruction], keep: set[str] | frozenset[str]) -> list[Instruction]:
    """Insert a Delete after the last read of every buffer not in `keep`.

    `keep` names the buffers that outlive the step (parameters, optimizer state) or that the
    controller fetches when the step ends. A buffer written and never read is freed at once.
    """
    last_use: dict[str, int] = {}
    for i, ins in enumerate(stream):
        for name in buffers_written(ins) + buffers_read(ins):
            last_use[name] = i
    frees: dict[int, list[str]] = {}
    for name, i in last_use.items():
        if name not in keep:
            frees.setdefault(i, []).append(name)
    out: list[Instruction] = []
    for i, ins in enumerate(stream):
        out.append(ins)
        out.extend(Delete(name) for name in sorted(frees.get(i, ())))
    return out


def with_recv_window(stream: list[Instruction], window: int) -> list[Instruction]:
    """`stream` with each receive posted only once the one `window` receives before it has
    been walked: at most `window` receives are outstanding (posted, not yet reached), so the
    memory a slice holds for received data it has not used is bounded by `window` bundles,
    while each transfer still overlaps the instructions between its post and its use.
    Apply last: the marks are instruction indices."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(
            f"the receive window must be a positive integer (receives outstanding at once), got {window!r}"
        )
    at = [i for i, ins in enumerate(stream) if isinstance(ins, Recv)]
    out = list(stream)
    for n, i in enumerate(at):
        out[i] = stream[i]._replace(post_after=at[n - window] if n >= window else -1)
    return out
