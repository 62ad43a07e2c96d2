"""Pipeline schedules as data.

A schedule is one ordered task list per slice; a task is (stage, microbatch, kind) with kind
F (forward), B (backward) or W (weight gradient). Generators build each slice's list as a
sequence of (stage, kind) *slots*; a slot's microbatch is how many earlier slots of the same
stage and kind the slice has (every stage runs its F, its B and its W in microbatch order),
so the lists are numpy arrays from the start (mpmd.schedules.task_arrays) and scale to 1,024 slices x
8,192 microbatches. `_slice_codes` is the shared shape of the 1F1B family: warm-up
forwards, then forward/backward pairs, then the remaining backwards, with weight-gradient
tasks optionally held back by a fixed lag; the V schedules are phase tables. Nothing here
imports jax: schedules can be printed, validated, simulated (mpmd.schedules.simulate) and drawn
(mpmd.schedules.render) without a device.

Placement (which slice holds which stage) is part of the schedule: `Schedule.placement[k]`
is stage k's slice, produced by the generator and read by everything downstream (lowering,
simulator, dry run, trainer, checkpoints). One stage per slice is the identity; interleaved
uses a loop (slice r holds r, r+p, ...); a V (`v_placement`: ZB-V, DualPipeV) or a shrunk
cluster only changes this table.

Dependencies (what validity means): F(s, mb) needs F(s-1, mb); B(s, mb) needs F(s, mb) and
B(s+1, mb) unless s is the last stage; W(s, mb) needs B(s, mb). Each slice runs its list
strictly in order, one task at a time.

Figures with F = B = W = 1 per stage (mpmd.schedules.simulate; p slices, m microbatches; "live" is the
most (stage, microbatch) activations a slice holds at once, a V stage being half a 1F1B
stage's layers, so 2p V-stage activations weigh what p 1F1B ones do):

  schedule          stages  bubble                 peak live on slice 0
  gpipe             p       (p-1)/(m+p-1)          m
  1f1b              p       (p-1)/(m+p-1)          p
  interleaved-1f1b  v*p     (p-1)/(v*m+p-1)        (v+1)p - 1 (m a multiple of p)
  zb-h1             p       (p-1)/(3m+p-1)         p
  zb-v              2p      (p-1)/(6m+p-1)         2p   (m >= 2p-1; = 1F1B's memory)
  dualpipe-v        2p      (p-1)/(6m+p-1)         2p+1 (m >= 2p-1)

(p-1)/(6m+p-1) is a lower bound for any schedule on a V with equal costs: slice p-1 cannot
start before p-1 forwards have passed, and every slice has 6m units of work.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from mpmd.schedules.task_arrays import BACKWARD, FORWARD, KIND_CODES, WEIGHT, Task, TaskArrays, occurrence_rank

_F, _B, _W = (KIND_CODES[k] for k in (FORWARD, BACKWARD, WEIGHT))


class Schedule(NamedTuple):
    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int  # stages per slice (the most any slice holds)
    split_backward: bool
    # One ordered task list per slice: a TaskArrays from the generators (reads as tuples of
    # Task, slice by slice), or any sequence of Task tuples built by hand.
    slices: tuple[tuple[Task, ...], ...]
    placement: tuple[int, ...]  # placement[k]: the slice that holds stage k

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    def stages_on(self, slice_index: int) -> tuple[int, ...]:
        """The stages slice `slice_index` holds, ascending."""
        return tuple(k for k, r in enumerate(self.placement) if r == slice_index)


class ScheduleError(ValueError):
    """A schedule that breaks placement, completeness or a dependency."""


def loop_placement(num_stages: int, num_slices: int) -> tuple[int, ...]:
    """Slice r holds stages r, r+p, r+2p, ...: consecutive stages sit on consecutive slices,
    so an interleaved schedule loops over the slices v times (one stage per slice when
    num_stages == num_slices)."""
    return tuple(k % num_slices for k in range(num_stages))


def v_placement(num_stages: int, num_slices: int) -> tuple[int, ...]:
    """Stages go down the slices and back up (0..p-1, p-1..0, 0..p-1, ...): slice 0 holds
    the first and the last stage, as in ZB-V and DualPipeV, so the pipeline's two ends meet
    on one slice and the turn at slice p-1 needs no transfer."""
    p = num_slices
    return tuple(k % p if (k // p) % 2 == 0 else p - 1 - k % p for k in range(num_stages))


def dependencies(task: Task, num_stages: int) -> tuple[tuple, ...]:
    """The tasks `task` must wait for (plain tuples; they compare and hash equal to Tasks)."""
    stage, mb, kind = task
    if kind == FORWARD:
        return ((stage - 1, mb, FORWARD),) if stage > 0 else ()
    if kind == BACKWARD:
        if stage == num_stages - 1:
            return ((stage, mb, FORWARD),)
        return ((stage, mb, FORWARD), (stage + 1, mb, BACKWARD))
    return ((stage, mb, BACKWARD),)


# ---------------------------------------------------------------------------------------
# Generators. A slot is coded stage * 3 + kind code; a slice's list is an int array of them.


def _slots(stages, kind: int) -> np.ndarray:
    return np.asarray(stages, dtype=np.int64) * 3 + kind


def _phases(*parts) -> np.ndarray:
    """One slice's slots from (pattern, repeats) parts: a pattern is a list of (stage, kind)."""
    pieces = [
        np.tile(np.array([s * 3 + k for s, k in pattern], dtype=np.int64), n)
        for pattern, n in parts
        if n > 0 and pattern
    ]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def _slice_codes(forward_stages, backward_stages, num_warmup: int, w_lag) -> np.ndarray:
    """One slice's slots for the 1F1B family.

    forward_stages / backward_stages: the stage of each forward / backward the slice runs,
    in run order. num_warmup: forwards run before the first backward; after them F and B
    alternate until the forwards run out, then the remaining backwards run.
    w_lag: None for a non-split backward (no W tasks). Otherwise the number of W tasks that
    may wait after their B; W runs oldest first and the rest are flushed at the end. A lag
    of 0 is B immediately followed by its W.
    """
    forwards, backwards = _slots(forward_stages, _F), _slots(backward_stages, _B)
    n, w = len(forwards), num_warmup
    assert len(backwards) == n and 0 <= w <= n
    # Backward i's unit: [the forward it pairs with] B_i [W of backward i - lag].
    units = np.full((n, 3), -1, dtype=np.int64)
    units[: n - w, 0] = forwards[w:]
    units[:, 1] = backwards
    parts = [forwards[:w]]
    if w_lag is not None:
        weights = backwards + (_W - _B)
        units[w_lag:, 2] = weights[: max(0, n - w_lag)]
    units = units.ravel()
    parts.append(units[units >= 0])
    if w_lag is not None:
        parts.append(weights[max(0, n - w_lag) :])
    return np.concatenate(parts)


def _build(
    name,
    num_stages,
    num_microbatches,
    virtual_stages,
    split_backward,
    placement,
    codes_per_slice,
    generated_microbatches=None,
) -> Schedule:
    """The Schedule of per-slice slot arrays. Generators that need a minimum number of
    microbatches to have their shape (the V schedules) build `generated_microbatches` and
    drop every task of a microbatch >= num_microbatches: removing whole microbatches keeps
    every remaining dependency and order, so the result stays deadlock-free."""
    m = num_microbatches
    codes_per_slice, ranks = list(codes_per_slice), []
    for r, codes in enumerate(codes_per_slice):
        mb = occurrence_rank(codes)
        if generated_microbatches is not None and generated_microbatches > m:
            keep = mb < m
            codes_per_slice[r], mb = codes[keep], mb[keep]
        ranks.append(mb)
    lengths = [len(codes) for codes in codes_per_slice]
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    stage, kind = np.empty(offsets[-1], np.int32), np.empty(offsets[-1], np.int8)
    for r, codes in enumerate(codes_per_slice):
        a, b = offsets[r], offsets[r + 1]
        np.floor_divide(codes, 3, out=stage[a:b], casting="unsafe")
        np.remainder(codes, 3, out=kind[a:b], casting="unsafe")
        codes_per_slice[r] = None  # free as we go: at 50 M tasks the slots weigh 400 MB
    arrays = TaskArrays(stage, np.concatenate(ranks), kind, offsets)
    return Schedule(name, num_stages, m, virtual_stages, split_backward, arrays, tuple(placement))


def _check_counts(name, num_stages, num_microbatches, virtual_stages, needs_full_pipeline):
    for field, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"schedule '{name}' needs {field} to be an integer >= 1, got {value!r}")
    if num_stages % virtual_stages:
        raise ValueError(
            f"schedule '{name}' needs num_stages divisible by virtual_stages "
            f"({virtual_stages}), got num_stages={num_stages}"
        )
    p = num_stages // virtual_stages
    # Schedules that run at most ~p microbatches in flight fill the pipeline only when there
    # are at least p of them; below that 1F1B's memory bound is moot and GPipe is the answer.
    if needs_full_pipeline and num_microbatches < p:
        raise ValueError(
            f"schedule '{name}' needs num_microbatches >= number of pipeline slices ({p}), got {num_microbatches}"
        )
    return p


def _per_rank(name, num_stages, num_microbatches, warmup, w_lag=None):
    """A one-stage-per-slice schedule; warmup(r, p) and w_lag(r, p) are per-slice knobs."""
    p, m = num_stages, num_microbatches
    codes = [
        _slice_codes(np.full(m, r), np.full(m, r), warmup(r, p), None if w_lag is None else w_lag(r, p))
        for r in range(p)
    ]
    return _build(name, p, m, 1, w_lag is not None, loop_placement(p, p), codes)


def gpipe(num_stages: int, num_microbatches: int, placement=None) -> Schedule:
    """GPipe: every forward, then every backward. Keeps all m microbatches alive.

    `placement` (stage -> slice; default one stage per slice) may put several stages on a
    slice, e.g. `v_placement(4, 2)`: a slice then runs its stages' forwards in ascending
    stage order and their backwards in descending order, which cannot deadlock for any
    placement (every wait points to a lower stage in the forward phase, a higher one in
    the backward phase).
    """
    _check_counts("gpipe", num_stages, num_microbatches, 1, needs_full_pipeline=False)
    m = num_microbatches
    if placement is None:
        return _per_rank("gpipe", num_stages, m, lambda r, p: m)
    placement = _check_placement("gpipe", num_stages, placement)
    codes = []
    for r in range(max(placement) + 1):
        mine = [k for k in range(num_stages) if placement[k] == r]
        codes.append(_slice_codes(np.repeat(mine, m), np.repeat(mine[::-1], m), len(mine) * m, None))
    most = max(placement.count(r) for r in range(len(codes)))
    return _build("gpipe", num_stages, m, most, False, placement, codes)


def _check_placement(name: str, num_stages: int, placement) -> tuple[int, ...]:
    """placement as a tuple, or ValueError unless it maps every stage onto slices 0..p-1
    with each slice holding at least one stage."""
    placement = tuple(placement)
    if len(placement) != num_stages or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in placement
    ):
        raise ValueError(
            f"schedule '{name}' needs placement to give a slice index >= 0 for each "
            f"of the {num_stages} stages, got {placement!r}"
        )
    empty = sorted(set(range(max(placement) + 1)) - set(placement))
    if empty:
        raise ValueError(
            f"schedule '{name}' placement {placement!r} leaves slice(s) {empty} "
            f"without a stage; number the slices 0..p-1"
        )
    return placement


def one_f_one_b(num_stages: int, num_microbatches: int, placement=None) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-flush).

    Slice r runs p-1-r warm-up forwards, then alternates F and B, then drains the remaining
    backwards. At most p-r microbatches are alive on slice r (p on slice 0), and the bubble
    is the same as GPipe's: (p-1)/(m+p-1).

    `placement` (default one stage per slice) may give each slice a contiguous block of
    stages, blocks in slice order (e.g. (0, 1, 1, 2): 4 stages on 3 slices, as a shrunk
    cluster runs them). The slice then runs its block like the one-stage slices it stands
    for, in whole microbatches: a microbatch's forwards ascend the block, its backwards
    descend it, and slice r warms up with p-1-r microbatches' forwards. This is 1F1B over
    the blocks taken as stages, so it is deadlock-free for the same reason; slice r holds
    at most (p-r) x (its block's size) stage activations.
    """
    if placement is None:
        _check_counts("1f1b", num_stages, num_microbatches, 1, needs_full_pipeline=True)
        return _per_rank("1f1b", num_stages, num_microbatches, lambda r, p: p - 1 - r)
    _check_counts("1f1b", num_stages, num_microbatches, 1, needs_full_pipeline=False)
    placement = _check_placement("1f1b", num_stages, placement)
    if list(placement) != sorted(placement):
        raise ValueError(
            f"schedule '1f1b' needs a placement of contiguous blocks in slice order "
            f"(non-decreasing, e.g. (0, 1, 1, 2)), got {placement!r}"
        )
    m, p, codes = num_microbatches, max(placement) + 1, []
    for r in range(p):
        mine = [k for k in range(num_stages) if placement[k] == r]
        forwards, backwards = _slots(mine, _F), _slots(mine[::-1], _B)
        warmup = min(p - 1 - r, m)
        steady = [forwards, backwards] * (m - warmup) + [backwards] * warmup
        codes.append(np.concatenate([forwards] * warmup + steady))
    most = max(placement.count(r) for r in range(len(codes)))
    return _build("1f1b", num_stages, m, most, False, placement, codes)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero Bubble H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

    1F1B with the backward split into B (input gradient, on the critical path) and W (weight
    gradient, needed by nobody downstream). Slice r keeps r W tasks waiting: its first r
    backwards run without their W, every later B is followed by the oldest waiting W, and the
    last r W fill the cool-down bubble. Peak live microbatches stay at p (counting a
    microbatch alive until its W), as in 1F1B; with F=B=W the bubble drops from 1F1B's
    3(p-1) time units per slice to about (p-1).
    """
    _check_counts("zb-h1", num_stages, num_microbatches, 1, needs_full_pipeline=True)
    return _per_rank("zb-h1", num_stages, num_microbatches, lambda r, p: p - 1 - r, w_lag=lambda r, p: r)


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron-style interleaved 1F1B: v = virtual_stages stages per slice, p = S / v slices.

    Slice r holds stages r, r+p, ..., r+(v-1)p. Microbatches go in groups of p: for each group
    the slice runs the forwards of its first stage for every microbatch of the group, then of
    its second stage, and so on; backwards follow the same order with the stages reversed.
    Warm-up is 2(p-1-r) + (v-1)p forwards (Megatron's count: the (v-1)p forwards of one group
    on the other stages, plus two per downstream slice for the forward/backward round trip).

    Needs m to be a multiple of p, as Megatron does: with a shorter (or longer) last group the
    fixed warm-up count no longer matches the order and validate() finds deadlocks, e.g. for
    p=4, v=3, m=5 or p=8, v=2, m=10. With m = k*p the bubble is (p-1)/(v*m+p-1).
    """
    name, v = "interleaved-1f1b", virtual_stages
    if v == 1:
        raise ValueError(
            f"schedule '{name}' needs virtual_stages >= 2 (stages per slice), got 1; use '1f1b' for one stage per slice"
        )
    p = _check_counts(name, num_stages, num_microbatches, v, needs_full_pipeline=True)
    m = num_microbatches
    if m % p:
        raise ValueError(
            f"schedule '{name}' needs num_microbatches to be a multiple of the number of pipeline slices ({p}), got {m}"
        )
    codes = []
    for r in range(p):
        # One group of p microbatches: each of the slice's stages p times, in chunk order.
        group = np.repeat(np.arange(v) * p + r, p)
        forwards, backwards = np.tile(group, m // p), np.tile(group[::-1], m // p)
        codes.append(_slice_codes(forwards, backwards, min(2 * (p - 1 - r) + (v - 1) * p, m * v), None))
    return _build(name, num_stages, m, v, False, loop_placement(num_stages, p), codes)


def _check_v(name: str, num_stages: int, num_microbatches: int) -> int:
    """The number of slices of a V schedule (two stages each); ValueError otherwise."""
    p = _check_counts(name, num_stages, num_microbatches, 1, needs_full_pipeline=False)
    if num_stages % 2:
        raise ValueError(
            f"schedule '{name}' puts two stages on each slice (a V), so it needs an even num_stages, got {num_stages}"
        )
    return p // 2


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6): p = S/2 slices,
    V placement (slice r holds stages r and 2p-1-r, its "chunk 0" and "chunk 1"), split
    backward.

    Slice r: 2(p-r)-1 chunk-0 forwards; r pairs (F1, F0); p-r triples (F1, B1, W1) -- the
    bottom of the V turns round and starts backwards at once; then the steady phase
    (F0, B0, W0, F1, B1, W1), dropping F0 once chunk 0 has run all m; then cool-down: r pairs
    (B0, B1) whose W wait, p-r pairs (B0, oldest waiting W0), and the waiting W1 and W0 last,
    where they fill the drain. A slice holds at most 2p stage-microbatches (slice 0: 2p-1
    chunk-0 warm-ups plus one chunk-1), i.e. 1F1B's peak memory with half-size stages. With
    F = B = W the makespan is 6m + p - 1: every slice idles only the p-1 units it cannot
    avoid (bubble (p-1)/(6m+p-1), the V's lower bound; 1F1B on the same model idles 6(p-1)
    of these units per slice, bubble (p-1)/(m+p-1)).

    The shape needs m >= 2p-1; for fewer microbatches the schedule for 2p-1 is built and
    the missing microbatches' tasks are dropped (still valid, more bubble).
    """

    def phases(r, p, M, c0, c1, F0, B0, W0, F1, B1, W1):
        return [
            ([F0], 2 * (p - r) - 1),
            ([F1, F0], r),
            ([F1, B1, W1], p - r),
            ([F0, B0, W0, F1, B1, W1], M - 2 * p + r + 1),
            ([B0, W0, F1, B1, W1], p - r - 1),
            ([B0, B1], r),
            ([B0, W0], p - r),
            ([W1], r),
            ([W0], r),
        ]

    return _v_schedule("zb-v", num_stages, num_microbatches, phases)


def _v_schedule(name: str, num_stages: int, num_microbatches: int, phases) -> Schedule:
    """A V schedule from its per-slice phase table: phases(r, p, M, c0, c1, F0, B0, W0, F1,
    B1, W1) -> [(pattern, repeats), ...] for slice r of p, built for M >= 2p-1 microbatches,
    c0 / c1 the slice's stages on the way down / up and F0 ... W1 their (stage, kind) slots."""
    p = _check_v(name, num_stages, num_microbatches)
    M = max(num_microbatches, 2 * p - 1)
    codes = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        slots = [(c, kind) for c in (c0, c1) for kind in (_F, _B, _W)]
        codes.append(_phases(*phases(r, p, M, c0, c1, *slots)))
    return _build(name, num_stages, num_microbatches, 2, True, v_placement(num_stages, p), codes, M)


def dualpipe_v(num_stages: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek, the "cut-in-half" DualPipe): p = S/2 slices, V placement,
    split backward.

    Slice r: 2(p-r-1) chunk-0 forwards; r+1 pairs (F0, F1); p-r-1 times (B1 W1, F1); the
    main phase of overlapped F&B pairs -- (F0 with B1 W1), (F1 with B0 W0) -- m-2p+r+1
    times; p-r-1 times (B1 W1, F1 with B0 W0); r+1 pairs (B1, B0) of which the second half
    leave their W waiting; p-r-1 times (oldest waiting W, B0 whose W waits); the waiting W
    last. DualPipe runs each F&B pair as one fused program so that one's communication hides
    under the other's compute; mpmd runs the two tasks back to back (no fused program), so
    the order is DualPipeV's and the overlap is not modelled. With F = B = W its bubble is
    ZB-V's, (p-1)/(6m+p-1), at 2p+1 live stage-microbatches per slice (one more than ZB-V:
    the F of a pair starts before the B of the pair frees its microbatch).

    Needs m >= 2p-1 for its shape; fewer microbatches are handled as in zb_v.
    """

    def phases(r, p, M, c0, c1, F0, B0, W0, F1, B1, W1):
        # The last r+1 backward pairs switch to deferred W half way (DualPipeV's zero-bubble
        # tail); which chunk defers first depends on r's parity, as in DualPipeV.
        half = (r + 1) // 2
        if r % 2:
            tail, deferred = [([B1, W1, B0, W0], half), ([B1, B0], r + 1 - half)], [c1, c0] * (r + 1 - half)
        else:
            tail, deferred = (
                [([B1, W1, B0, W0], half), ([B1, W1, B0], 1), ([B1, B0], r - half)],
                [c0] + [c1, c0] * (r - half),
            )
        # The waiting W run oldest first: those of the tail, then those of step 7's B0s.
        queue = deferred + [c0] * (p - r - 1)
        return [
            ([F0], 2 * (p - r - 1)),
            ([F0, F1], r + 1),
            ([B1, W1, F1], p - r - 1),
            ([F0, B1, W1, F1, B0, W0], M - 2 * p + r + 1),
            ([B1, W1, F1, B0, W0], p - r - 1),
            *tail,
            *[([(queue[i], _W), B0], 1) for i in range(p - r - 1)],
            ([(c, _W) for c in queue[p - r - 1 :]], 1),
        ]

    return _v_schedule("dualpipe-v", num_stages, num_microbatches, phases)


class ScheduleSpec(NamedTuple):
    """A schedule and its traits: everything the config, the tuner and `make` ask about it, so
    adding a schedule is one `register_schedule(ScheduleSpec(...))` beside its generator.

    build(num_stages, num_microbatches, virtual_stages) -> Schedule; it checks the microbatch
    rules itself (raising ValueError that names the argument). virtual_stages: (least, most)
    stages per slice it takes, most None = no bound; default_virtual_stages: what `make` and the
    config use when none are given. placement: "loop" (slice r holds r, r+p, ...) or "v"
    (down the slices and back up). split_backward: B is the input gradient only and W tasks
    exist."""

    name: str
    build: Callable[[int, int, int], Schedule]
    virtual_stages: tuple[int, int | None] = (1, 1)
    default_virtual_stages: int = 1
    placement: str = "loop"
    split_backward: bool = False


# name -> ScheduleSpec, in registration order (the order the config and `mpmd tune` list them).
SCHEDULES: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Adds a schedule to every place that lists schedules (make, the config's
    pipeline.schedule and tune.schedule_names, the tuner's search); ValueError if its name is
    taken or its traits do not hold together."""
    if not isinstance(spec, ScheduleSpec):
        raise ValueError(f"register_schedule takes a ScheduleSpec, got {type(spec).__name__}")
    if spec.name in SCHEDULES:
        raise ValueError(f"schedule {spec.name!r} is already registered")
    least, most = spec.virtual_stages
    if not (
        1 <= least
        and (most is None or least <= most)
        and spec.placement in ("loop", "v")
        and (spec.default_virtual_stages == 1 or least <= spec.default_virtual_stages)
    ):
        raise ValueError(
            f"schedule {spec.name!r}: virtual_stages={spec.virtual_stages} must be (least >= 1, "
            f"most >= least or None), default_virtual_stages within it (or 1: must be given) "
            f"and placement 'loop' or 'v', got {spec}"
        )
    SCHEDULES[spec.name] = spec
    return spec


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered spec of schedule `name`; ValueError listing the known ones."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(sorted(SCHEDULES))}")
    return SCHEDULES[name]


def _one_stage(generator):
    return lambda num_stages, num_microbatches, virtual_stages: generator(num_stages, num_microbatches)


register_schedule(ScheduleSpec("gpipe", _one_stage(gpipe)))
register_schedule(ScheduleSpec("1f1b", _one_stage(one_f_one_b)))
# Default 1: interleaved-1f1b's stages per slice must be given (its generator says so).
register_schedule(ScheduleSpec("interleaved-1f1b", interleaved_one_f_one_b, virtual_stages=(2, None)))
register_schedule(ScheduleSpec("zb-h1", _one_stage(zb_h1), split_backward=True))
register_schedule(ScheduleSpec("zb-v", _one_stage(zb_v), (2, 2), 2, "v", True))
register_schedule(ScheduleSpec("dualpipe-v", _one_stage(dualpipe_v), (2, 2), 2, "v", True))


def default_virtual_stages(name: str) -> int:
    """Stages per slice schedule `name` takes when none are asked for (its spec's; 1 for a
    name that is not registered, which `make` then refuses)."""
    return SCHEDULES[name].default_virtual_stages if name in SCHEDULES else 1


def make(name: str, num_stages: int, num_microbatches: int, virtual_stages: int | None = None) -> Schedule:
    """Build schedule `name`; ValueError (naming what is allowed) for impossible arguments.
    virtual_stages (stages per slice) defaults to the schedule's own (its spec's
    default_virtual_stages: 1, or 2 for the V schedules); interleaved-1f1b needs it given (>= 2)."""
    spec = schedule_spec(name)
    v = spec.default_virtual_stages if virtual_stages is None else virtual_stages
    least, most = spec.virtual_stages
    if least == most and v != least:
        shape = " (it holds two stages per slice, a V)" if spec.placement == "v" else ""
        others = [n for n, s in SCHEDULES.items() if s.virtual_stages[0] != s.virtual_stages[1]]
        hint = (
            f"; only {' and '.join(repr(n) for n in others)} take{'s' * (len(others) == 1)} virtual stages"
            if least == 1 and others
            else ""
        )
        raise ValueError(f"schedule '{name}' supports only virtual_stages={least}{shape}, got {virtual_stages!r}{hint}")
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1 and (v < least or (most is not None and v > most)):
        allowed = f">= {least}" if most is None else f"in {least}..{most}"
        raise ValueError(f"schedule '{name}' needs virtual_stages {allowed} (stages per slice), got {v}")
    schedule = spec.build(num_stages, num_microbatches, v)
    place = v_placement if spec.placement == "v" else loop_placement
    assert (
        schedule.name == name
        and schedule.split_backward == spec.split_backward
        and schedule.placement == place(num_stages, schedule.num_slices)
    ), (spec, schedule.name)
    return schedule
