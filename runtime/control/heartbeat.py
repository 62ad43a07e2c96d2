"""Telling a hung worker from a busy one, in well under a second: the control plane's heartbeats.

Every worker is sent a Heartbeat RPC each round, every HEARTBEAT_S (with many workers every
num_workers x ROUND_COST_S, so that the rounds cost the controller a bounded share of a core).
Its answer keeps the worker's lease (runtime/worker/main.py), carries its progress (the step
watchdog's, runtime/control/runs.py) and proves it alive (WorkerClient.last_ok).

A Heartbeat is answered by the worker's Python (an RPC thread, and the GIL), so a busy worker
answers late: on this 2-core machine under load (gpt_small compiling, stepping and saving
beside four CPU hogs, load average 7-17) round trips reached 0.5-1.2 s, late on the worker's
side and on the controller's alike (docs/benchmarks.md, "Hung or busy"). A threshold on that
silence short enough to find a hung worker in well under a second would find busy ones too.
Nor does the step's expected time help: the late answers came while programs compiled and
loaded and checkpoints were written, not in proportion to a step. What tells the two apart is
whether the *process* runs at all: a stopped, frozen or cut-off worker answers nothing, while a
busy one still runs gRPC's own threads, which accept a connection, do its TLS handshake and
acknowledge an HTTP/2 PING without Python. Hence two signals:

- suspicion: a worker whose Heartbeat has gone unanswered for SUSPECT_S is probed;
- the probe (`ping_options`): a connection of its own, which must be up within the probes'
  timeout and whose one keepalive PING, sent PING_AFTER_S later, must be acknowledged within
  it too (gRPC closes the connection otherwise), carrying one more Heartbeat. Its Heartbeat
  answered, or its deadline passed with the connection up and the PING acknowledged
  (DEADLINE_EXCEEDED: busy), and the worker is alive; it is probed again while its heartbeat
  stays unanswered. The probe failing UNAVAILABLE (no connection, or its PING unacknowledged)
  makes the worker hung until it answers a Heartbeat again, and its slice lost
  (ControlPlane.lost_slice).

gRPC's threads get no CPU either when the machine is overloaded: at a load average of 15 on 2
cores a new connection took up to 0.44 s (median 50 ms; a quiet machine: milliseconds), so a
fixed 0.3 s found live workers hung, 10 times in 20 gpt_small steps. So the probes' timeout
is measured, not fixed: once a CALIBRATE_S a connection is made to the next worker in turn and
timed, and the timeout is probe_timeout_s or PROBE_MARGIN x the slowest of the last
NUM_CONNECTS connections, whichever is longer. A stopped worker is found hung about
SUSPECT_S + that timeout (plus up to a round) after it stopped: 0.5-0.65 s on a quiet machine.
A false verdict needs a live worker whose Python has not answered for SUSPECT_S and whose
gRPC threads take more than PROBE_MARGIN times the slowest recent connection to connect or to
acknowledge a PING: a load that rises that much within NUM_CONNECTS x CALIBRATE_S seconds.

A worker not yet steady gets a second chance: its first failed probe only makes it doubted,
and it is probed again at once with CONFIRM_FACTOR x the timeout; a second failure makes it
hung. Steady means it has returned a run that called no program for the first time since it
was loaded (ControlPlane._wait; a replacement makes every worker unsteady again):
a worker compiling its first step (or a hot spare compiling in the background) holds its GIL
for seconds while the machine is at its busiest, and under that load (test_ray beside
test_gang_ray on 2 cores, 3 of 10 runs) a live worker's probe handshake took over 0.3 s before
any slow connection had been timed. A stopped steady worker is still found after one probe.

failure_timeout_s stays the bound: a worker silent that long is lost whatever its probes
said (its Python may be stuck while gRPC answers), and with probe_timeout_s None it is the
only rule.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref

import grpc

from mpmd.runtime.wire import verbs
from mpmd.runtime.wire.results import Aborted, Progress
from mpmd.runtime.control.rpc import WorkerError, receive, send

HEARTBEAT_S = 0.1  # a round of heartbeats every this many seconds ...
ROUND_COST_S = 0.5e-3  # ... or every num_workers x this (a round costs ~50 us a worker here)
# A Heartbeat's deadline: one lost with its connection (a host cut off without a reset) is
# sent again after this long, so an idle worker's lease is kept once the link is back.
HEARTBEAT_DEADLINE_S = 10.0
SUSPECT_S = 0.2  # a Heartbeat unanswered this long gets its worker probed
PROBE_TIMEOUT_S = 0.3  # the default floor of the probes' timeout (a worker not yet warm, whose
# handshake under heavy load can take longer, is probed twice, the second time with twice this)
PING_AFTER_S = 0.05  # a probe's PING goes this long after its connection is up
CALIBRATE_S = 1.0  # a timed connection to one worker (in turn) every this many seconds
NUM_CONNECTS = 30  # the probes' timeout follows the slowest of this many recent connections
PROBE_MARGIN = 3.0  # ... times this
CALIBRATION_TIMEOUT_S = 10.0  # a timed connection slower than this is not counted
CONFIRM_FACTOR = 2.0  # a worker not yet steady, doubted by one probe, is probed again with this x the timeout


def ping_options(timeout_s: float) -> list[tuple[str, int]]:
    """gRPC channel options of a probe's connection: its own (not the shared subchannel a
    client's channel would reuse), up within `timeout_s` (a connect attempt's deadline is the
    minimum reconnect backoff), one keepalive PING PING_AFTER_S after, acknowledged within
    `timeout_s`. gRPC sends a client's pings at most once a second, so a probe has one."""
    ms = max(1, round(min(timeout_s, 3600.0) * 1e3))
    return [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.min_reconnect_backoff_ms", ms),
        ("grpc.initial_reconnect_backoff_ms", ms),
        ("grpc.keepalive_time_ms", round(PING_AFTER_S * 1e3)),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class _Beat:
    """One worker's heartbeat state: when its unanswered Heartbeat was sent (None: none is),
    whether a probe is under way, why it is hung (None: it is not) and when it was last found so,
    whether one failed probe doubts it, and whether it is steady (one probe is then enough)."""

    __slots__ = ("sent_at", "probing", "hung", "hung_at", "doubted", "steady")

    def __init__(self):
        self.sent_at: float | None = None
        self.probing = False
        self.hung: str | None = None
        self.hung_at = float("-inf")
        self.doubted = False
        self.steady = False


class Heartbeats:
    """The heartbeats of a control plane's workers (a round at a time, from its heartbeat
    thread), their probes and verdicts. probe_timeout_s: the floor of the probes' timeout
    (see the module); None: no probes, a worker is lost only by failure_timeout_s."""

    def __init__(self, probe_timeout_s: float | None = PROBE_TIMEOUT_S):
        self.probe_timeout_s = probe_timeout_s
        self._beats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> _Beat
        self._lock = threading.Lock()
        self.connects_s: collections.deque = collections.deque(maxlen=NUM_CONNECTS)  # timed connections
        self._calibrated_at = 0.0
        self._turn = 0
        self._calibration = None  # (client of the connection being timed, its ready future)
        self.probes = 0  # probes started
        self.busy = 0  # probes that found their worker alive, its Python late
        self.doubts = 0  # first failed probes of workers not yet steady (probed again, not hung yet)

    @property
    def probe_timeout_s(self) -> float | None:
        return self._probe_timeout_s

    @probe_timeout_s.setter
    def probe_timeout_s(self, value: float | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"probe_timeout_s must be positive or None (no probes), got {value!r}")
        self._probe_timeout_s = value

    def timeout_s(self) -> float | None:
        """The probes' timeout now: probe_timeout_s, or PROBE_MARGIN x the slowest recent
        timed connection where that is longer; None: no probes."""
        if self.probe_timeout_s is None:
            return None
        with self._lock:  # appended to from gRPC's threads
            slowest_s = max(self.connects_s, default=0.0)
        return max(self.probe_timeout_s, PROBE_MARGIN * slowest_s)

    def settle(self, clients, steady: bool = True) -> None:
        """Mark `clients` steady (each returned a run that called no program for the first time:
        one failed probe finds it hung) or, with steady=False, not (programs loaded, a recovery)."""
        with self._lock:
            for c in clients:
                self._beats.setdefault(c, _Beat()).steady = steady

    @staticmethod
    def period_s(num_workers: int) -> float:
        return max(HEARTBEAT_S, num_workers * ROUND_COST_S)

    def hung(self, client) -> str | None:
        """Why `client`'s worker (a WorkerClient, or a GangClient: any of its processes) counts
        as hung, or None."""
        beat = self._beats.get(client)
        return beat.hung if beat is not None else None

    def round(self, clients) -> None:
        """Send a Heartbeat to each client without one unanswered; probe those whose
        Heartbeat has been unanswered for SUSPECT_S; time a connection once a CALIBRATE_S."""
        now = time.monotonic()
        timeout_s = self.timeout_s()
        for c in clients:
            with self._lock:
                beat = self._beats.setdefault(c, _Beat())
                fresh = beat.sent_at is None
                if fresh:
                    beat.sent_at = now
                suspect = not fresh and timeout_s is not None and not beat.probing
                suspect = suspect and now - beat.sent_at > SUSPECT_S
                if suspect:
                    beat.probing = True
                    confirming = beat.doubted  # a second probe: its failure finds the worker hung
            if fresh:
                self._send(c, beat)
            elif suspect:
                t = timeout_s * (CONFIRM_FACTOR if confirming else 1.0)
                self._probe(c, beat, now - beat.sent_at, t, confirming)
        if timeout_s is not None and clients and now - self._calibrated_at >= CALIBRATE_S:
            self._calibrated_at = now
            self._turn += 1
            self._calibrate(clients[self._turn % len(clients)])

    def close(self) -> None:
        """Close the connection being timed, if any (probes close their own)."""
        if self._calibration is not None:
            self._calibration[1].cancel()
            self._calibration[0].close()
            self._calibration = None

    def _send(self, c, beat: _Beat) -> None:
        try:
            fut = send(c, verbs.Empty(), timeout_s=HEARTBEAT_DEADLINE_S, verb="Heartbeat")
        except WorkerError:  # closed: replaced while we looked
            beat.sent_at = None
            return
        fut.add_done_callback(lambda f: self._answered(c, beat, f))

    def _answered(self, c, beat: _Beat, fut) -> None:
        try:
            progress = receive(c, "Heartbeat", fut)[0].progress
        except (WorkerError, Aborted):
            progress = None  # gone or refused: its silence goes on counting (last_ok)
        else:
            with self._lock:
                beat.hung = None  # it answers: whatever a probe said, it runs
                beat.doubted = False
        with self._lock:
            beat.sent_at = None
        if isinstance(progress, list) and len(progress) == 3:
            progress = Progress(*progress)
            if progress != c.progress:
                c.progress, c.progress_at = progress, time.monotonic()

    def _calibrate(self, c) -> None:
        """Time a new connection to `c`'s worker (a gang's first process) into connects_s;
        the one timed before is closed now, done or not. A connection that waited for a worker
        found hung meanwhile (it connects once it runs again) is not counted."""
        self.close()
        with self._lock:
            beat = self._beats.setdefault(c, _Beat())
        probe = getattr(c, "members", [c])[0].sibling(ping_options(CALIBRATION_TIMEOUT_S))
        t0 = time.monotonic()
        fut = probe.ready_future()
        self._calibration = (probe, fut)

        def connected(f):
            with self._lock:
                if not f.cancelled() and beat.hung_at < t0:
                    self.connects_s.append(time.monotonic() - t0)

        fut.add_done_callback(connected)

    def _probe(self, c, beat: _Beat, silent_s: float, timeout_s: float, confirming: bool) -> None:
        """Probe every process of `c`'s worker (a gang's each) on a connection of its own;
        the first that fails UNAVAILABLE makes a steady worker hung, or a worker not yet
        steady doubted (`confirming`: it was, and this probe's failure makes it hung)."""
        members = getattr(c, "members", [c])
        pending = [len(members), False]  # members not yet answered; whether one failed
        self.probes += 1
        for m in members:
            probe = m.sibling(ping_options(timeout_s))
            # Its deadline: past a connection's timeout, then its PING's.
            fut = send(probe, verbs.Empty(), timeout_s=2 * timeout_s + PING_AFTER_S + 0.1, verb="Heartbeat")
            fut.add_done_callback(
                lambda f, m=m, probe=probe: self._probed(c, beat, m, probe, f, silent_s, timeout_s, pending, confirming)
            )

    def _probed(
        self, c, beat: _Beat, member, probe, fut, silent_s: float, timeout_s: float, pending: list, confirming: bool
    ) -> None:
        e = fut.exception() if not fut.cancelled() else None
        code = e.code() if isinstance(e, grpc.RpcError) else None
        with self._lock:
            if code == grpc.StatusCode.UNAVAILABLE and beat.sent_at is not None:
                if not (beat.steady or confirming):
                    pending[1] = True  # not steady yet: probed again, with CONFIRM_FACTOR x the timeout
                else:
                    beat.hung = (
                        f"hung: its heartbeat unanswered for {silent_s:.2f} s, then worker {member.address} took "
                        f"no new connection or left its ping unanswered for {timeout_s:.2g} s (probe timeout: "
                        f"probe_timeout_s={self.probe_timeout_s:g}, or {PROBE_MARGIN:g} x the slowest recent "
                        f"connection){'; probed twice, not warm yet' if confirming else ''}: {e.details()}"
                    )
                    beat.hung_at = time.monotonic()
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.busy += 1
            elif e is None:
                beat.hung = None  # its Python answered on the new connection
            pending[0] -= 1
            if pending[0] == 0:
                beat.doubted = pending[1] and beat.hung is None
                self.doubts += beat.doubted
                beat.probing = False
        threading.Thread(target=probe.close, daemon=True).start()  # not on gRPC's callback thread
