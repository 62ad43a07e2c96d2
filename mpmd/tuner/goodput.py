"""Goodput, predicted: a run of S slices for a wall time (or a number of steps) under failures,
simulated event by event over the failure times, every candidate policy and every trial at
once as numpy lanes (no Python loop over steps or slices: 1,024 slices cost what 4 do).

    costs = goodput.Costs(step_s=0.06, save_s=0.16)      # measured: mpmd.report.costs.measured(run_dir)
    hosts = goodput.Hosts(num_slices=1024, mtbf_s=1000 * 3600)
    faults = goodput.draw(hosts, wall_s=86400, trials=64, seed=0)
    out = goodput.simulate(costs, [goodput.Policy(every=2000, memory_every=100)], faults, 1024, wall_s=86400)
    out.goodput.mean(), out.lost_s["replay"].mean()

The intervals that maximise goodput are searched with it by mpmd/tuner/intervals.py.

The model, in wall seconds (every cost a measured figure, Costs):
- A step costs step_s on all S slices; on fewer (after a shrink) step_s * S / width, the same
  work spread over the survivors (the ideal: a real narrow layout is no faster).
- A step that saves to the persistent tier (a multiple of `every`) adds save_s, one that
  snapshots to the in-memory tier (a multiple of `memory_every`) adds snapshot_s: what each
  costs the wall, the slowing of the steps after an asynchronous save included. A save can be
  restored from once its step ends (a recovery waits for a save in flight, as the Trainer does).
- Failures (`draw`): every host fails after an exponential time of mean mtbf_s, and takes
  every slice on it: `slices_per_host` contiguous slices, or the one slice a gang of
  `hosts_per_slice` hosts holds. Slice r's in-memory copy lives on slice r + 1 (the ring of
  mpmd/train/snapshots.py), so a host of two slices or more takes a slice with its copy and
  the memory tier cannot serve that loss. The controller's host fails like any other: the
  whole job starts again from the persistent tier (every worker spawned and compiling).
  A known trace (the times and slices of real faults) is `trace`.
- A loss costs, one part after another: detect_s (until the loss is declared); then each lost
  slice's place is taken: by a warm hot spare when one is ready for each (promote_s; a
  new spare is started in the background and is ready replace_wait_s + spawn_s + compile_s
  later), else as `on_loss` says:
    replace  replace_wait_s (until a worker can be had: capacity) + spawn_s (started, set up,
             programs shipped), and compile_s on the first step after (the new worker compiles)
    shrink   the run goes on without the lost slices: relayout (compile_s, every slice at
             once) from the persistent tier, at reduced width until a worker can be had
             (replace_wait_s + spawn_s after the loss) and the next persistent checkpoint is
             reached, where it moves back (restore_s + compile_s, counted as relayout)
    auto     replace when replace_wait_s <= replace_timeout_s, else replace_timeout_s waited
             in vain (capacity) and shrink; on fewer slices already, shrink at once
  then the restore: from the in-memory tier when it survived and is at least as new as the
  persistent one (its newest snapshot: the last restore's step, which a restore snapshots at
  once as the Trainer does, or a multiple of memory_every since; memory_restore_s), else from the persistent tier (restore_s; the initial
  state when nothing was saved yet, at the same cost).
- Replay: what was done between the step restored and the failure is done again. It is
  counted as the wall time no other cause takes (steps run twice and the part of a step a
  failure cut); saves and snapshots count as such, on replayed steps too.
- A loss during a recovery starts the recovery again; the part of the first not run is not
  counted.
- Goodput = useful / wall, useful = the steps in the state at the end x step_s (the partial
  step at the end of a wall time counted as done), so useful + sum(lost_s) = wall exactly.
Not modeled: failures of spares or storage, a loss during a save's write, step-time variance,
the run's own start (its first compile), controller restarts by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Causes of lost time, in the order a page prints them; useful + their sum = wall.
CAUSES = (
    "save",
    "snapshot",
    "detect",
    "capacity",
    "spawn",
    "promote",
    "relayout",
    "restore",
    "compile",
    "narrow",
    "replay",
)
# A recovery's parts in the order they happen (a loss during one cuts the last ones first).
RECOVERY = ("detect", "capacity", "spawn", "promote", "relayout", "restore", "compile")
ON_LOSS = ("replace", "shrink", "auto")


class Costs(NamedTuple):
    """Seconds each part of a run costs the wall. Defaults: gpt_tiny on 4 local worker processes
    of the development machine (2 cores; docs/benchmarks.md, bench_recovery.py's breakdown and
    bench_goodput.py's measured costs): a guide to the shape of the answer, not a figure for
    your cluster."""

    step_s: float = 0.06  # a step without a save, all slices
    save_s: float = 0.16  # added by a persistent save (checkpoint.every)
    snapshot_s: float = 0.005  # added by an in-memory snapshot (checkpoint.memory_every)
    detect_s: float = 0.05  # a loss until it is declared (a SIGKILL: the RPC fails at once)
    spawn_s: float = 0.6  # a new worker started, set up and its programs shipped
    promote_s: float = 0.035  # a warm hot spare takes a lost slice's place (bench_recovery: setup + ship)
    restore_s: float = 0.5  # every slice back from the persistent tier
    memory_restore_s: float = 0.13  # every slice back from the in-memory tier
    compile_s: float = 0.28  # the first step on a new worker (or after a relayout), over a step


class Hosts(NamedTuple):
    """Where the slices run and how often a host fails."""

    num_slices: int
    mtbf_s: float  # mean time between failures of one host
    slices_per_host: int = 1  # a host's loss takes all of them (contiguous slices)
    hosts_per_slice: int = 1  # a gang: the slice goes with any of its hosts

    @property
    def num_hosts(self) -> int:
        """Worker hosts, the controller's not counted."""
        return (
            self.num_slices * self.hosts_per_slice
            if self.hosts_per_slice > 1
            else -(-self.num_slices // self.slices_per_host)
        )

    @property
    def failure_every_s(self) -> float:
        """Mean time between failures of the whole job (every worker host and the controller's)."""
        return self.mtbf_s / (self.num_hosts + 1)

    @property
    def memory_share(self) -> float:
        """The share of failures the in-memory tier can serve: a worker host's that takes one
        slice (its copy is on the next slice's host), in a job of two slices or more."""
        if self.num_slices < 2:
            return 0.0
        if self.hosts_per_slice > 1 or self.slices_per_host == 1:
            served = self.num_hosts
        else:  # only a last host left holding a single slice
            served = int(self.num_slices % self.slices_per_host == 1)
        return served / (self.num_hosts + 1)


class Policy(NamedTuple):
    """What the run is configured to do: checkpoint intervals in steps (0 = never: the persistent
    tier then only holds the initial state; memory_every 0 = no in-memory tier), hot spares,
    and the elastic policy (cluster.on_loss, replace_timeout_s) with how long a new worker
    takes to be had (replace_wait_s: 0 where one starts at once)."""

    every: int = 0
    memory_every: int = 0
    hot_spares: int = 0
    on_loss: str = "replace"
    replace_wait_s: float = 0.0
    replace_timeout_s: float = 60.0


class Faults(NamedTuple):
    """Failure events of `trials` runs: times_s (trials, J), sorted per trial, padded with inf;
    lost (trials, J) slices lost; memory_ok (trials, J) the in-memory tier can serve it; whole
    (trials, J) the controller's host: every slice starts again. With at_step, times_s holds
    positions in the run instead (steps done and a fraction of the next, `trace`)."""

    times_s: np.ndarray
    lost: np.ndarray
    memory_ok: np.ndarray
    whole: np.ndarray
    at_step: bool = False


class Result(NamedTuple):
    """Per (policy, trial), arrays of shape (policies, trials): wall seconds, steps in the final
    state, goodput, lost seconds by cause (CAUSES), failures, restores from the memory tier."""

    wall_s: np.ndarray
    steps: np.ndarray
    goodput: np.ndarray
    lost_s: dict
    failures: np.ndarray
    memory_restores: np.ndarray


def check(costs: Costs, hosts: Hosts | None = None, policies: Sequence[Policy] = ()) -> None:
    """ValueError naming the field and what is allowed, for input a user can get wrong."""
    for name, value in costs._asdict().items():
        if not (math.isfinite(value) and value >= 0) or (name == "step_s" and value == 0):
            raise ValueError(
                f"{name} must be a finite number of seconds {'> 0' if name == 'step_s' else '>= 0'}, got {value!r}"
            )
    if hosts is not None:
        if hosts.num_slices < 1:
            raise ValueError(f"num_slices must be at least 1, got {hosts.num_slices}")
        if not (hosts.mtbf_s > 0):
            raise ValueError(f"mtbf must be > 0 (a mean time between a host's failures), got {hosts.mtbf_s!r}")
        if hosts.slices_per_host < 1 or hosts.hosts_per_slice < 1:
            raise ValueError("slices_per_host and hosts_per_slice must be at least 1")
        if hosts.slices_per_host > 1 and hosts.hosts_per_slice > 1:
            raise ValueError(
                f"a host holds several slices (slices_per_host={hosts.slices_per_host}) or a slice spans "
                f"several hosts (hosts_per_slice={hosts.hosts_per_slice}), not both"
            )
    for p in policies:
        if p.every < 0 or p.memory_every < 0 or p.hot_spares < 0:
            raise ValueError(f"every, memory_every and hot_spares must be >= 0, got {p}")
        if p.on_loss not in ON_LOSS:
            raise ValueError(f"on_loss must be one of {', '.join(ON_LOSS)}, got {p.on_loss!r}")
        if not (p.replace_wait_s >= 0 and p.replace_timeout_s >= 0):
            raise ValueError(f"replace_wait_s and replace_timeout_s must be >= 0, got {p}")


def draw(hosts: Hosts, wall_s: float, trials: int, seed: int = 0) -> Faults:
    """Failures of `trials` runs of wall_s seconds: each host (and the controller's) fails after
    exponential times of mean mtbf_s, which over the job is a Poisson process of rate
    (hosts + 1) / mtbf_s, each failure on a host drawn uniformly."""
    check(Costs(), hosts)
    rng = np.random.default_rng(seed)
    num_hosts = hosts.num_hosts
    counts = rng.poisson(wall_s / hosts.failure_every_s, trials)
    width = max(int(counts.max()), 1)
    times = np.sort(np.where(np.arange(width) < counts[:, None], rng.uniform(0.0, wall_s, (trials, width)), np.inf))
    host = rng.integers(0, num_hosts + 1, (trials, width))  # num_hosts: the controller's
    whole = host == num_hosts
    if hosts.hosts_per_slice > 1:
        lost = np.ones_like(host)
    else:
        k = hosts.slices_per_host
        lost = np.minimum(hosts.num_slices - host * k, k)
    lost = np.where(whole, hosts.num_slices, lost)
    memory_ok = (lost == 1) & ~whole & (hosts.num_slices > 1)
    return Faults(times, lost, memory_ok, whole)


def trace(num_slices: int, events: Sequence[tuple[float, Sequence[int]]], at_step: bool = False) -> Faults:
    """One run's known faults: (time_s, the slices lost then) each; the in-memory tier serves
    an event when no lost slice's ring peer ((r + 1) % num_slices) was lost with it.
    at_step: each event's first item is where it struck the run instead, steps done and the
    fraction of the next (37.4): it comes when the run, resumed after the fault before it,
    gets there, so a machine running slower or faster than the costs say moves no fault
    to another step (how bench_goodput.py replays measured runs)."""
    events = sorted(events, key=lambda e: e[0])
    times = np.array([[float(t) for t, _ in events] or [np.inf]])
    lost = np.array([[len(s) for _, s in events] or [0]])
    ok = [num_slices > 1 and not any((r + 1) % num_slices in set(s) for r in s) for _, s in events]
    return Faults(times, lost, np.array([ok or [False]]), np.zeros_like(lost, dtype=bool), at_step)


def _count(step, per_step):
    """Multiples of `every` in 1..step, per_step = 1 / every (0: never). In floating point, which
    numpy divides several times faster than int64: exact while step < 2^50, as
    floor((k * every + 0.5) / every) = k and floor((k * every - 0.5) / every) = k - 1."""
    return np.floor((step + 0.5) * per_step)


class _Lanes:
    """The state of every (policy, trial) lane: where it resumed (step s0 at time r), its width
    (slices), when it may grow back, its spares' ready times, and its books."""

    def __init__(self, costs: Costs, policies: Sequence[Policy], trials: int, num_slices: int, start_step: int):
        c = costs
        rep = lambda values, dtype: np.repeat(np.asarray(values, dtype=dtype), trials)
        self.c, self.S = c, num_slices
        self.trial = np.tile(np.arange(trials), len(policies))
        n = len(self.trial)
        self.every = rep([p.every for p in policies], np.int64)
        self.mem = rep([p.memory_every for p in policies], np.int64)
        self.per_every = np.where(self.every > 0, 1.0 / np.maximum(self.every, 1), 0.0)
        self.per_mem = np.where(self.mem > 0, 1.0 / np.maximum(self.mem, 1), 0.0)
        on_loss = rep([ON_LOSS.index(p.on_loss) for p in policies], np.int64)
        self.wait = rep([p.replace_wait_s for p in policies], float)
        timeout = rep([p.replace_timeout_s for p in policies], float)
        auto = on_loss == ON_LOSS.index("auto")
        self.auto = auto
        self.shrinks = (on_loss == ON_LOSS.index("shrink")) | (auto & (self.wait > timeout))
        # Waited for a worker before the slice is replaced (or, auto giving up, before shrinking).
        self.capacity = np.where(self.shrinks, np.where(auto, timeout, 0.0), self.wait)
        spares = rep([p.hot_spares for p in policies], np.int64)
        self.ready = np.where(np.arange(max(int(spares.max(initial=0)), 1)) < spares[:, None], 0.0, np.inf)
        self.s0 = np.full(n, start_step, np.int64)
        self.r = np.zeros(n)
        self.width = np.full(n, num_slices, np.int64)
        self.grow_at = np.full(n, np.inf)
        self.lost = {cause: np.zeros(n) for cause in CAUSES}
        self.last = np.zeros((n, len(RECOVERY)))  # the last recovery's parts, for a loss cutting it
        self.failures = np.zeros(n, np.int64)
        self.memory_restores = np.zeros(n, np.int64)

    def step_s(self, i):
        return self.c.step_s * self.S / self.width[i]

    def span(self, i, n):
        """Seconds lanes i take for their next n steps from s0."""
        s0, e, m = self.s0[i], self.per_every[i], self.per_mem[i]
        return (
            n * self.step_s(i)
            + self.c.save_s * (_count(s0 + n, e) - _count(s0, e))
            + self.c.snapshot_s * (_count(s0 + n, m) - _count(s0, m))
        )

    def steps_within(self, i, elapsed):
        """The most steps lanes i complete within `elapsed` seconds after resuming: a binary
        search near elapsed / (the mean step with its saves), where the answer lies within
        (save_s + snapshot_s) / step_s steps."""
        ts = self.step_s(i)
        mean = ts + self.c.save_s / np.maximum(self.every[i], 1) * (self.every[i] > 0)
        mean = mean + self.c.snapshot_s / np.maximum(self.mem[i], 1) * (self.mem[i] > 0)
        # |answer - elapsed / mean| <= (save_s + snapshot_s) / step_s + 1: a run of n steps holds
        # n / every saves give or take one, and step_s is the shortest a step is.
        slack = math.ceil((self.c.save_s + self.c.snapshot_s) / self.c.step_s) + 2
        guess = np.floor(elapsed / mean).astype(np.int64)
        lo = np.maximum(guess - slack, 0)
        hi = np.minimum(guess + slack, np.floor(elapsed / ts).astype(np.int64))
        lo = np.minimum(lo, hi)
        while np.any(lo < hi):
            mid = (lo + hi + 1) // 2
            ok = self.span(i, mid) <= elapsed
            lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
        return lo

    def event_time(self, i, when, at_step: bool):
        """Lanes i's time of an event at `when`: seconds, or with at_step a position (steps done
        and a fraction of the next) reached after the last resume, at once if already past."""
        if not at_step:
            return when
        done = np.floor(np.nan_to_num(when, posinf=0.0)).astype(np.int64)
        later = self.span(i, np.maximum(done - self.s0[i], 0)) + (when - done) * self.step_s(i)
        return np.where(np.isfinite(when), self.r[i] + later, np.inf)

    def run(self, i, n):
        """Lanes i ran n steps from s0: book their saves, snapshots and reduced width."""
        s0, e, m = self.s0[i], self.per_every[i], self.per_mem[i]
        self.lost["save"][i] += self.c.save_s * (_count(s0 + n, e) - _count(s0, e))
        self.lost["snapshot"][i] += self.c.snapshot_s * (_count(s0 + n, m) - _count(s0, m))
        self.lost["narrow"][i] += n * (self.step_s(i) - self.c.step_s)
        self.s0[i] = s0 + n

    def cut(self, i, seconds):
        """A recovery of lanes i ended `seconds` early (a new loss, or the end of the wall time):
        its last parts did not happen."""
        for col in reversed(range(len(RECOVERY))):
            part = np.minimum(seconds, self.last[i, col])
            self.lost[RECOVERY[col]][i] -= part
            self.last[i, col] -= part
            seconds = seconds - part

    def grow_back(self, i, until, steps):
        """Narrow lanes i whose worker came move back to all slices at the first persistent
        checkpoint they reach after it, when that is before `until` and before step `steps`."""
        until = np.broadcast_to(until, i.shape)
        waiting = (self.width[i] < self.S) & (self.every[i] > 0) & (self.grow_at[i] < until)
        i, until = i[waiting], until[waiting]
        if not len(i):
            return
        after = np.maximum(self.grow_at[i] - self.r[i], 0.0)
        reached = self.s0[i] + np.where(after > 0, self.steps_within(i, after), 0)
        boundary = (reached // self.every[i] + 1) * self.every[i]
        at = self.r[i] + self.span(i, boundary - self.s0[i])
        go = (at <= until) & (boundary < steps)
        i, boundary, at = i[go], boundary[go], at[go]
        self.run(i, boundary - self.s0[i])
        move = self.c.restore_s + self.c.compile_s
        self.lost["relayout"][i] += move
        self.last[i] = 0.0
        self.last[i, RECOVERY.index("relayout")] = move
        self.r[i] = at + move
        self.width[i], self.grow_at[i] = self.S, np.inf

    def fail(self, i, t, lost, memory_ok, whole):
        """Lanes i lose `lost` slices at time t (s): run up to it, restore, book the recovery."""
        c = self.c
        inside = t < self.r[i]  # during a recovery: it starts again
        self.cut(i[inside], (self.r[i] - t)[inside])
        elapsed = np.maximum(t - self.r[i], 0.0)
        resumed = self.s0[i]
        self.run(i, np.where(inside, 0, self.steps_within(i, elapsed)))
        s = self.s0[i]
        persistent = np.where(self.every[i] > 0, s // np.maximum(self.every[i], 1) * self.every[i], 0)
        # Spares: a lost slice takes a ready one while they last.
        ready = np.sort(self.ready[i], axis=1)
        usable = np.where(whole, 0, np.minimum(lost, (ready <= t[:, None]).sum(axis=1)))
        need = lost - usable
        promoted = np.arange(ready.shape[1]) < usable[:, None]
        self.ready[i] = np.where(promoted, t[:, None] + self.wait[i, None] + c.spawn_s + c.compile_s, ready)
        narrow = self.width[i] < self.S
        shrink = (need > 0) & ~whole & (self.shrinks[i] | (self.auto[i] & narrow))
        replace = (need > 0) & ~shrink
        memory = memory_ok & (self.mem[i] > 0) & ~shrink & ~whole
        # The newest snapshot: the resume point's (taken at every restore), or a multiple of
        # memory_every since.
        in_memory = np.maximum(resumed, s - s % np.maximum(self.mem[i], 1))
        use_memory = memory & (in_memory >= persistent)
        parts = np.zeros((len(i), len(RECOVERY)))
        parts[:, RECOVERY.index("detect")] = c.detect_s
        capacity = np.where(self.auto[i] & narrow, 0.0, self.capacity[i])
        parts[:, RECOVERY.index("capacity")] = np.where(shrink, capacity, np.where(replace, self.wait[i], 0.0))
        parts[:, RECOVERY.index("spawn")] = np.where(replace, c.spawn_s, 0.0)
        parts[:, RECOVERY.index("promote")] = np.where((need == 0) & ~whole, c.promote_s, 0.0)
        parts[:, RECOVERY.index("relayout")] = np.where(shrink, c.compile_s, 0.0)
        parts[:, RECOVERY.index("restore")] = np.where(use_memory, c.memory_restore_s, c.restore_s)
        parts[:, RECOVERY.index("compile")] = np.where(replace, c.compile_s, 0.0)
        for col, cause in enumerate(RECOVERY):
            self.lost[cause][i] += parts[:, col]
        self.last[i] = parts
        self.r[i] = t + parts.sum(axis=1)
        self.s0[i] = np.where(use_memory, in_memory, persistent)
        # Fewer slices until a worker comes; a whole restart, or a replacement, is all of them.
        self.width[i] = np.where(shrink, np.maximum(self.width[i] - need, 1), np.where(whole, self.S, self.width[i]))
        self.grow_at[i] = np.where(
            shrink,
            np.maximum(np.nan_to_num(self.grow_at[i], posinf=0.0), t + self.wait[i] + c.spawn_s),
            self.grow_at[i],
        )
        self.grow_at[i] = np.where(whole, np.inf, self.grow_at[i])
        self.failures[i] += 1
        self.memory_restores[i] += use_memory


def simulate(
    costs: Costs,
    policies: Sequence[Policy],
    faults: Faults,
    num_slices: int,
    wall_s: float | None = None,
    steps: int | None = None,
    start_step: int = 0,
) -> Result:
    """Every policy under every trial's faults, until wall_s seconds have passed or the run's
    state holds step `steps` (one of the two), from step `start_step` at time 0."""
    if (wall_s is None) == (steps is None):
        raise ValueError("give the run's length as wall_s or as steps, one of the two")
    check(costs, None, policies)
    trials, num_events = faults.times_s.shape
    lanes = _Lanes(costs, policies, trials, num_slices, start_step)
    wall = np.inf if wall_s is None else float(wall_s)
    last_step = np.iinfo(np.int64).max // 4 if steps is None else int(steps)
    every_lane = np.arange(len(lanes.trial))
    going = every_lane
    for j in range(num_events):
        t = lanes.event_time(going, faults.times_s[lanes.trial[going], j], faults.at_step)
        lanes.grow_back(going, np.minimum(t, wall), last_step)
        t = lanes.event_time(going, faults.times_s[lanes.trial[going], j], faults.at_step)
        end = np.minimum(wall, lanes.r[going] + lanes.span(going, np.maximum(last_step - lanes.s0[going], 0)))
        hit = t < end  # the others ended before it: so they do before every later one
        going = going[hit]
        if not len(going):
            break
        k = lanes.trial[going]
        lanes.fail(going, t[hit], faults.lost[k, j], faults.memory_ok[k, j], faults.whole[k, j])
    # The end: the wall time, or the time the last step completes.
    lanes.grow_back(every_lane, wall, last_step)
    i = every_lane
    left = np.maximum(last_step - lanes.s0, 0)
    end = np.minimum(wall, lanes.r + lanes.span(i, left)) if steps is not None else np.full(len(i), wall)
    inside = end < lanes.r
    lanes.cut(i[inside], (lanes.r - end)[inside])
    elapsed = np.maximum(end - lanes.r, 0.0)
    n = np.where(inside, 0, lanes.steps_within(i, elapsed) if steps is None else left)
    ts = lanes.step_s(i)
    partial = np.where(inside, 0.0, np.clip(elapsed - lanes.span(i, n), 0.0, ts)) * lanes.c.step_s / ts
    lanes.run(i, n)
    useful = (lanes.s0 - start_step) * costs.step_s + partial
    lost = {cause: lanes.lost[cause] for cause in CAUSES}
    lost["replay"] = end - useful - sum(lost[c] for c in CAUSES if c != "replay")
    shape = (len(policies), trials)
    return Result(
        end.reshape(shape),
        lanes.s0.reshape(shape),
        (useful / end).reshape(shape),
        {cause: v.reshape(shape) for cause, v in lost.items()},
        lanes.failures.reshape(shape),
        lanes.memory_restores.reshape(shape),
    )
