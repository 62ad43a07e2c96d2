"""TransferTransport between real worker processes on CPU, over each path: "socket"
(jax.experimental.transfer), "shm" (shared memory, runtime/wire/shm.py) and "shm+pinned"
(shared memory staged through pinned host memory both ways, as on an accelerator: CPU
devices have a pinned_host memory too, so the path runs here as it does there).

Each worker is a separate Python process driven over stdin/stdout with one JSON request per
line; it answers one JSON line. Payloads are made from a seed on the sender, and both ends
report a SHA-256 of the raw bytes and shapes, so equality is bitwise (the float32 payload is
random bit patterns, NaN payloads included).
"""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import xla

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # worker processes or a controller (tests/README.md)

REPO = Path(__file__).resolve().parents[2]

WORKER = r"""
import gc, hashlib, json, os, sys
os.sched_setaffinity(0, {int(sys.argv[3])})    # pinned by itself: no preexec_fn in a threaded parent
import jax, numpy as np
from mpmd.runtime.worker.instructions import Spec
from mpmd.runtime.worker.mesh import bind
from mpmd.runtime.wire.transport import TransferTransport

def payload(seed):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 2**32, (256, 256), dtype=np.uint32).view(np.float32),
            rng.integers(-2**31, 2**31, 7, dtype=np.int32),
            np.zeros((0, 3), np.float32))         # zero-size: made by the receiver

def digest(arrays):
    return hashlib.sha256(repr([(a.shape, a.dtype) for a in arrays]).encode()
                          + b"".join(np.asarray(a).tobytes() for a in arrays)).hexdigest()

SPECS = tuple(Spec(a.shape, a.dtype.name) for a in payload(0))
device = jax.devices()[0]
mode, _, staging = sys.argv[2].partition("+")
transport = TransferTransport(int(sys.argv[1]), bind((1, 1, 1), [device]), secret=b"test-transfer-secret",
                              transport=mode, host_staging=staging or "auto")
pending, kept = {}, []

def segments():      # the shared-memory segments this process maps, and the memfds it holds open
    with open("/proc/self/maps") as f:
        maps = sorted({line.split()[5].removeprefix("/memfd:") for line in f if "memfd:mpmd-shm" in line})
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:       # the listing's own
            pass
    return {"maps": maps, "fds": [l for l in fds if "memfd:" in l]}

def reply(**kw):
    print(json.dumps(kw), flush=True)

reply(address=transport.address)
for line in sys.stdin:
    req = json.loads(line)
    op = req["op"]
    if op == "connect":
        try:
            transport.connect_peers({int(k): v for k, v in req["addresses"].items()})
        except ValueError as e:
            reply(error=str(e))
        else:
            reply(path=transport.path(1 - int(sys.argv[1])))
    elif op == "send":
        arrays = tuple(jax.device_put(a, device) for a in payload(req["seed"]))
        transport.send(req["key"], arrays, req["dst"])
        reply(digest=digest(arrays))
    elif op == "recv":
        pending[req["key"]] = transport.recv(req["key"], req["src"], SPECS)
        reply()
    elif op == "done":
        reply(done=pending[req["key"]].done())
    elif op == "wait":
        try:
            arrays = pending.pop(req["key"]).result(timeout=req.get("timeout_s", 20))
        except Exception as e:
            reply(error=f"{type(e).__name__}: {e}")
        else:
            if req.get("keep"):
                kept.append(arrays)
            reply(digest=digest(arrays), on_device=all(a.devices() == {device} for a in arrays))
            arrays = a = None      # only `kept` holds what arrived
    elif op == "segments":
        if req.get("drop"):
            kept.clear()
        gc.collect()
        reply(**segments())
    elif op == "reset":
        transport.reset()
        reply()
    elif op == "generation":
        transport.generation = req["generation"]
        reply()
    elif op == "fail_next_segment":  # the next segment this sender takes: out of memory
        from mpmd.runtime.wire import shm
        take = shm._Pool.take
        def take_once(self, *args, _take=take):
            shm._Pool.take = _take
            raise OSError(12, "Cannot allocate memory")
        shm._Pool.take = take_once
        reply()
    elif op == "close":
        transport.close()
        kept.clear()
        gc.collect()
        from mpmd.runtime.wire.shm import endpoint
        own = "@" + endpoint(b"test-transfer-secret", transport.address)[1:].decode()
        with open("/proc/net/unix") as f:
            listening = any(line.split()[-1] == own for line in f if len(line.split()) == 8)
        reply(listening=listening, **segments())
        break
"""


class Worker:
    def __init__(self, slice_index: int, transport: str = "auto"):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), XLA_FLAGS=xla.flags())
        cpu = slice_index % os.cpu_count()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(slice_index), transport, str(cpu)],
            env=env,
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.address = self._read(timeout_s=60)["address"]

    def _read(self, timeout_s: float = 20) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"worker {self.proc.pid} did not answer within {timeout_s} s"
        line = self.proc.stdout.readline()
        assert line, f"worker {self.proc.pid} exited with {self.proc.wait()}"
        return json.loads(line)

    def __call__(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps(dict(op=op, **kw)) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # stdin's buffer could not be flushed: the worker is gone
                pass


def start_pair(transport: str = "auto", transports: tuple[str, str] | None = None) -> list[Worker]:
    """Two workers connected both ways; `transports`: each one's own, else `transport` for both.
    Each worker's path from its peer is in `.path` (or its refusal in `.error`)."""
    workers = []
    try:
        workers = [Worker(i, t) for i, t in enumerate(transports or (transport, transport))]
        addresses = {i: w.address for i, w in enumerate(workers)}
        for w in workers:
            answer = w("connect", addresses=addresses)
            w.path, w.error = answer.get("path"), answer.get("error")
        return workers
    except BaseException:
        for w in workers:
            w.kill()
        raise


@pytest.fixture(scope="module", params=["socket", "shm", "shm+pinned"])
def pair(request):
    workers = start_pair(request.param)
    assert [w.path for w in workers] == [request.param.partition("+")[0]] * 2
    try:
        yield workers
    finally:
        for w in workers:
            w.kill()


@pytest.mark.parametrize("src,dst", [(0, 1), (1, 0)])
def test_send_then_recv_is_bitwise_equal(pair, src, dst):
    key = f"step0/s{src}->s{dst}/mb0/act"
    sent = pair[src]("send", key=key, dst=dst, seed=src * 10 + 1)
    pair[dst]("recv", key=key, src=src)
    got = pair[dst]("wait", key=key)
    assert got == {"digest": sent["digest"], "on_device": True}


@pytest.mark.parametrize("src,dst", [(0, 1), (1, 0)])
def test_recv_posted_before_send_waits_for_it(pair, src, dst):
    key = f"step1/s{src}->s{dst}/mb0/act"
    pair[dst]("recv", key=key, src=src)
    time.sleep(0.3)
    assert pair[dst]("done", key=key) == {"done": False}  # waiting, not failed
    sent = pair[src]("send", key=key, dst=dst, seed=src * 10 + 2)
    assert pair[dst]("wait", key=key) == {"digest": sent["digest"], "on_device": True}


def test_many_in_flight_both_ways_out_of_order(pair):
    items = [(src, mb) for src in (0, 1) for mb in range(6)]

    def key(src, mb):
        return f"step2/s{src}->s{1 - src}/mb{mb}/act"

    for src, mb in items:  # odd microbatches: receive posted before the send
        if mb % 2:
            pair[1 - src]("recv", key=key(src, mb), src=src)
    sent = {
        (src, mb): pair[src]("send", key=key(src, mb), dst=1 - src, seed=100 + 10 * src + mb)
        for src, mb in reversed(items)
    }
    for src, mb in items:
        if not mb % 2:
            pair[1 - src]("recv", key=key(src, mb), src=src)
    for src, mb in items:
        assert pair[1 - src]("wait", key=key(src, mb))["digest"] == sent[src, mb]["digest"]


def test_a_sender_of_an_older_generation_pairs_with_nothing(pair):
    """Fencing (runtime/worker/service.py, "Generations"): the receiver is in generation 2, a
    sender left in generation 1 (a replaced worker still running) offers the very key it
    waits for: nothing lands. The same key offered in generation 2 does."""
    key = "step9/s0->s1/mb0/act"
    try:
        pair[0]("generation", generation=1)
        pair[1]("generation", generation=2)
        pair[1]("recv", key=key, src=0)
        pair[0]("send", key=key, dst=1, seed=91)
        time.sleep(0.5)
        assert pair[1]("done", key=key) == {"done": False}
        pair[0]("generation", generation=2)
        sent = pair[0]("send", key=key, dst=1, seed=92)
        assert pair[1]("wait", key=key)["digest"] == sent["digest"]
    finally:
        for w in pair:
            w("generation", generation=0)


def test_reset_fails_the_pulls_waiting_on_this_slice(pair):
    key = "step3/s0->s1/mb0/act"
    pair[1]("recv", key=key, src=0)
    time.sleep(0.2)
    pair[0]("reset")
    error = pair[1]("wait", key=key)["error"]
    assert "PullTable::Reset" in error if pair[1].path == "socket" else "slice 0 reset its transfers" in error
    # The pair still works afterwards.
    key = "step4/s0->s1/mb0/act"
    sent = pair[0]("send", key=key, dst=1, seed=7)
    pair[1]("recv", key=key, src=0)
    assert pair[1]("wait", key=key)["digest"] == sent["digest"]


@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_recv_from_a_killed_peer_fails_instead_of_hanging(transport):
    workers = start_pair(transport)
    try:
        key = "step0/s0->s1/mb0/act"
        # One completed transfer first, so the connection is established.
        sent = workers[0]("send", key="warmup", dst=1, seed=3)
        workers[1]("recv", key="warmup", src=0)
        assert workers[1]("wait", key="warmup")["digest"] == sent["digest"]
        workers[1]("recv", key=key, src=0)
        workers[0].kill()
        assert "error" in workers[1]("wait", key=key, timeout_s=10)
    finally:
        for w in workers:
            w.kill()
