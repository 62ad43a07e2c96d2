"""Stopping a training run on request: Ctrl-C, and SIGTERM, the preemption notice of SLURM,
Kubernetes and Ray.

Either signal asks the loop (recipes/run/train.py) to send no further step, collect the steps in
flight and commit a checkpoint of the last one, so the same command resumes from it. A
preemption also comes with a deadline: the scheduler kills the process `train.preempt_grace_s`
after its SIGTERM. So a SIGTERM also arms an alarm `RESERVE_S` before that deadline; if the
run is still collecting or saving then (a hung slice, a slow disk), the alarm raises
`Preempted` out of whatever wait the controller is in, the run abandons what is in flight and
keeps the last commit, and the reserve is left for stopping the workers (a local cluster's
shutdown takes up to ~7 s when a worker does not answer). `PREEMPTED_EXIT` (143 = 128 +
SIGTERM, what a shell reports for a process killed by SIGTERM) tells the scheduler the run did
not finish: a Kubernetes Job or a SLURM requeue runs the same command again, and it resumes.

A second Ctrl-C interrupts at once (KeyboardInterrupt); a first one stops like a SIGTERM
without a deadline, and the run exits 0.
"""

from __future__ import annotations

import signal
import threading

PREEMPTED_EXIT = 143
RESERVE_S = 10.0  # of the grace, kept for stopping the workers once the alarm fires


class Preempted(BaseException):
    """The grace after a SIGTERM ran out before the run committed a checkpoint of its last
    step. A BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way
    out of a wait swallows it."""

    def __init__(self, grace_s: float):
        super().__init__(
            f"the {grace_s:g} s grace after SIGTERM ran out before the steps in flight were collected and committed"
        )
        self.grace_s = grace_s


class StopRequest:
    """The signal handlers of one training loop; `requested` is the signal's name once one came.
    Installed only on the main thread (Python delivers signals there), restored by `restore`."""

    def __init__(self, grace_s: float):
        self.requested = None
        self.grace_s = grace_s
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
                self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def preempted(self) -> bool:
        return self.requested == "SIGTERM"

    def _handle(self, signum, frame):
        if signum == signal.SIGALRM:
            raise Preempted(self.grace_s)
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGTERM:  # a preemption, even after a Ctrl-C
            if not self.preempted:  # the first SIGTERM arms the alarm; another changes nothing
                signal.setitimer(signal.ITIMER_REAL, self.grace_s - RESERVE_S)
            self.requested = "SIGTERM"
        else:
            self.requested = self.requested or "SIGINT"

    def restore(self):
        """Disarm the alarm and put the previous handlers back."""
        if self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
