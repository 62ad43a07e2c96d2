"""The heartbeats' probes on a real worker process (runtime/control/heartbeat.py): a stopped
worker not yet warm (no run of it returned without a first call of a program) is found hung by
a second probe (its first only doubts it), a steady one by its first, and one that runs again
is not hung any more; and the worker takes the probes' keepalive PINGs without closing the
connection (a GOAWAY, too_many_pings, would fail a probe still waiting on a busy worker)."""

import os
import signal
import time

import pytest

from mpmd.runtime.control.heartbeat import HEARTBEAT_S, Heartbeats, ping_options
from tests.support.processes import StandaloneWorkers

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # a worker process, SIGSTOP (tests/README.md)


def _rounds_until(beats: Heartbeats, client, done, timeout_s: float = 10.0) -> bool:
    """Heartbeat rounds to `client`, as the control plane's thread sends them, until done()."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats.round([client])
        if done():
            return True
        time.sleep(HEARTBEAT_S)
    return False


def test_a_stopped_worker_not_yet_steady_is_hung_after_a_second_probe_a_steady_one_after_one(tmp_path):
    with StandaloneWorkers(tmp_path, 1, shared=False) as workers:
        client, pid = workers.client(0), workers.procs[0].pid
        beats = Heartbeats(0.3)
        try:
            # A probe's connection held 3.5 s: gRPC pings once a second on it, and the worker's
            # server, at gRPC's defaults, sent a GOAWAY at the third ping (the channel to IDLE).
            probe, states = client.sibling(ping_options(2.0)), []
            probe._channel.subscribe(states.append, try_to_connect=True)
            time.sleep(3.5)
            seen = [s.name for s in states]
            probe.close()
            assert "READY" in seen and seen[seen.index("READY") :] == ["READY"], seen

            assert _rounds_until(beats, client, lambda: len(beats.connects_s) > 0)  # a connection timed
            os.kill(pid, signal.SIGSTOP)
            assert _rounds_until(beats, client, lambda: beats.hung(client) is not None)
            assert beats.doubts == 1, beats.doubts
            assert "probed twice, not warm yet" in beats.hung(client)
            os.kill(pid, signal.SIGCONT)
            assert _rounds_until(beats, client, lambda: beats.hung(client) is None)

            beats.settle([client])  # as the control plane does once the worker returns a step
            os.kill(pid, signal.SIGSTOP)
            assert _rounds_until(beats, client, lambda: beats.hung(client) is not None)
            assert beats.doubts == 1 and "probed twice" not in beats.hung(client), beats.hung(client)
        finally:
            os.kill(pid, signal.SIGCONT)
            beats.close()
            client.close()
