"""The same-host data plane (runtime/wire/shm.py) between real worker processes: who gets
which path, what is left mapped after close() and after a SIGKILL of either side, and what
a refused `shm` says. The transfers themselves are tested over both paths in test_transport.py;
training over shm against socket, and a stranger without the secret, with real workers in
test_multiprocess.py and test_security.py; a SIGKILL of a real worker at the end here."""

import os
import signal
import time

import optax
import pytest

import mpmd
from mpmd import models
from tests.runtime.test_transport import start_pair
from tests.support.reference import batches, make_gpt

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # real worker processes (tests/README.md)

GONE_TIMEOUT_S = 10


def _exchange(workers, tag: str, keep: bool = False) -> dict:
    """One transfer each way; {receiver: digest}; `keep`: the receivers hold on to what they got."""
    digests = {}
    for src, dst in ((0, 1), (1, 0)):
        key = f"{tag}/s{src}->s{dst}"
        sent = workers[src]("send", key=key, dst=dst, seed=src + 1)
        workers[dst]("recv", key=key, src=src)
        got = workers[dst]("wait", key=key, keep=keep)
        assert got["digest"] == sent["digest"]
        digests[dst] = got["digest"]
    return digests


def _segments_until(worker, wanted, **kw) -> dict:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        got = worker("segments", **kw)
        if wanted(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_auto_picks_shared_memory_on_one_host_and_socket_leaves_it_alone():
    for transport, path in (("auto", "shm"), ("socket", "socket")):
        workers = start_pair(transport)
        try:
            assert [w.path for w in workers] == [path, path]
            _exchange(workers, "warmup")
            mapped = [w("segments")["maps"] for w in workers]
            # Each side maps what it lent and what it received: s0->s1 and s1->s0.
            assert mapped == ([["mpmd-shm-s0-to1-1", "mpmd-shm-s1-to0-1"]] * 2 if path == "shm" else [[], []])
        finally:
            for w in workers:
                w.kill()


def test_a_segment_that_cannot_be_made_fails_that_transfer_and_the_next_goes_through():
    """No memory (or fd) for a segment is that transfer's failure, said to the receiver; the
    connection stays up for the next one, never a pull waiting forever."""
    workers = start_pair("shm")
    try:
        _exchange(workers, "warmup")
        workers[0]("fail_next_segment")
        workers[0]("send", key="k1", dst=1, seed=1)
        workers[1]("recv", key="k1", src=0)
        got = workers[1]("wait", key="k1", timeout_s=10)
        assert "could not send: OSError" in got.get("error", ""), got
        _exchange(workers, "after")
    finally:
        for w in workers:
            w.kill()


def test_shm_is_refused_where_a_peer_has_no_shared_memory_endpoint():
    # Worker 1 runs the socket path only, as a worker on another host would look from here.
    workers = start_pair(transports=("shm", "socket"))
    try:
        assert workers[0].error == (
            "transport 'shm' cannot reach slice 1 at " + workers[1].address + ": its worker "
            "has no shared-memory endpoint on this host (another host?); use transport auto "
            "or socket"
        )
        assert workers[1].path == "socket"
    finally:
        for w in workers:
            w.kill()


def test_close_leaves_no_segment_no_fd_and_no_endpoint():
    workers = start_pair("shm")
    try:
        _exchange(workers, "a", keep=True)
        _exchange(workers, "b", keep=True)  # two in flight each way: two segments
        assert all(len(w("segments")["maps"]) >= 3 for w in workers)
        closed = [w("close") for w in workers]
        assert closed == [{"listening": False, "maps": [], "fds": []}] * 2
    finally:
        for w in workers:
            w.kill()


def test_pinned_staging_lands_copies_so_the_segment_goes_back_at_once():
    # Staged through pinned host memory (as on an accelerator), what the receiver keeps is a
    # copy on the device: each transfer's segment returns to its sender's pool as soon as it
    # has landed, so the second kept transfer reuses the first one's segment. (Pageable on
    # CPU, kept arrays alias their segments: test_close_leaves_... sees two per direction.)
    workers = start_pair("shm+pinned")
    try:
        assert [w.path for w in workers] == ["shm", "shm"]
        _exchange(workers, "a", keep=True)
        _exchange(workers, "b", keep=True)
        both = ["mpmd-shm-s0-to1-1", "mpmd-shm-s1-to0-1"]
        assert [_segments_until(w, lambda s: s["maps"] == both)["maps"] for w in workers] == [both, both]
    finally:
        for w in workers:
            w.kill()


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_either_side_frees_the_survivors_segments(victim):
    workers = start_pair("shm")
    survivor = workers[1 - victim]
    try:
        _exchange(workers, "warmup")
        digests = _exchange(workers, "kept", keep=True)
        assert survivor("segments")["maps"], "nothing went through shared memory"
        workers[victim].kill()
        # What the survivor lent to the victim goes with the connection; what it received
        # stays mapped only while the arrays made from it live, and keeps its bytes.
        got = _segments_until(survivor, lambda s: all(f"-to{victim}-" not in m for m in s["maps"]))
        # Segment 1 both times: the warm-up's came back to its sender's pool when its arrays died.
        kept = f"mpmd-shm-s{victim}-to{1 - victim}-1"  # (Python's mmap holds an fd of its own)
        assert got == {"maps": [kept], "fds": [f"/memfd:{kept} (deleted)"]}
        assert _segments_until(survivor, lambda s: not s["maps"], drop=True) == {"maps": [], "fds": []}
        assert digests[1 - victim]  # read while its sender was alive: bitwise as sent
    finally:
        for w in workers:
            w.kill()


def _mapped(pid: int) -> dict:
    """What process `pid` holds of shared memory: segments mapped, memfds open."""
    with open(f"/proc/{pid}/maps") as f:
        maps = sorted({line.split()[5] for line in f if "memfd:mpmd-shm" in line})
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return {"maps": maps, "fds": [l for l in fds if "memfd:" in l]}


@pytest.mark.parametrize("victim", [0, 1])
def test_a_sigkilled_workers_peer_keeps_no_shared_memory(workers, tmp_path, victim):
    """Real workers (gRPC, the executor): after a step over shared memory, SIGKILL either one;
    the survivor, whose only peer it was, unmaps every segment and holds no memfd, and
    nothing was ever put in /dev/shm."""
    cluster = workers
    make = lambda: mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    trainer = mpmd.Trainer(
        make(), optax.sgd(0.05, momentum=0.9), schedule="1f1b", num_microbatches=4, cluster=cluster, run_dir=tmp_path
    )
    try:
        x, y = batches()[0]
        trainer.step(x, y)
        survivor = cluster.pids[1 - victim]
        assert _mapped(survivor)["maps"], "the step did not go through shared memory"
        os.kill(cluster.pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while _mapped(survivor)["maps"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _mapped(survivor) == {"maps": [], "fds": []}
        assert not [n for n in os.listdir("/dev/shm") if "mpmd" in n]
    finally:
        trainer.close(close_cluster=False)
