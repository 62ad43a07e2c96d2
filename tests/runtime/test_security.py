"""Who may touch a cluster: the data plane keyed by the session's secret, checkpoint paths
confined to the worker's root. Real worker processes, real gRPC, a real stranger process."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import optax
import pytest

from mpmd import models
import mpmd
from mpmd.runtime.control.client import WorkerError
from mpmd.runtime.control.cluster import StepFailed
from mpmd.runtime.wire.transport import key_to_uuid
from tests.support.reference import BATCH, D, SEQ, batches, make_gpt, train_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.platform]  # worker processes or a controller (tests/README.md)

ROOT = Path(__file__).resolve().parents[2]
M = 4  # microbatches
STEPS_TIMEOUT_S = 120  # the 3 steps take ~5 s; a stolen activation stalls them for good

# A process with JAX but no token and no secret: it connects to the workers' transfer
# servers and pulls, before the step, every id an unkeyed hash of the step's predictable
# keys would give (and its neighbours), with the right shape. It reports how many arrived.
ATTACKER = r"""
import hashlib, json, os, sys
import jax, numpy as np
from jax.experimental import transfer
addresses, keys, shape = json.loads(sys.argv[1])
device = jax.devices()[0]
server = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"] * 2)
spec = jax.ShapeDtypeStruct(tuple(shape), np.float32, sharding=jax.sharding.make_single_device_sharding(device))
pulled = []
for address in addresses:
    connection = server.connect(address)
    for key in keys:
        plain = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        for guess in (plain - 1, plain, plain + 1):
            pulled += connection.pull(guess % 2**64, [spec])
print("posted", len(pulled), flush=True)
sys.stdin.readline()
print(json.dumps({"received": sum(a.is_ready() for a in pulled), "posted": len(pulled)}), flush=True)
os._exit(0)
"""


# The same stranger on the shared-memory path (runtime/wire/shm.py): it finds the workers'
# endpoints as any local process can (/proc/net/unix; the test hands it the names), and on
# each tries a handshake with a made-up MAC followed by pulls of the guessed ids, pulls with
# no handshake at all, and a connection that says nothing (the handshake must not wait on it
# for anyone). It reports what came back: data messages and file descriptors.
ATTACKER_SHM = r"""
import hashlib, json, os, select, socket, sys
endpoints, keys, _shape = json.loads(sys.argv[1])
guesses = [g % 2**64 for key in keys
           for plain in [int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")]
           for g in (plain - 1, plain, plain + 1)]
def connect(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(b"\0" + name.encode())
    return s
def send_all(s, messages):
    try:
        for m in messages:
            s.send(json.dumps(m).encode())
    except OSError:
        pass
tried, silent = [], []
for name in endpoints:
    forged = connect(name)
    forged.recv(4096)                                   # the server's nonce
    send_all(forged, [["auth", 1, os.urandom(16).hex(), os.urandom(32).hex()]]
                     + [["pull", i, g] for i, g in enumerate(guesses)])
    bare = connect(name)
    send_all(bare, [["pull", i, g] for i, g in enumerate(guesses)])
    tried += [forged, bare]
    silent.append(connect(name))
print("posted", len(tried), flush=True)
sys.stdin.readline()
report = {"endpoints": len(endpoints), "data": 0, "fds": 0, "closed": 0}
for s in tried:
    while select.select([s], [], [], 1.0)[0]:
        try:
            data, fds, _, _ = socket.recv_fds(s, 65536, 4)
        except OSError:
            data, fds = b"", []
        report["fds"] += len(fds)
        if not data:
            report["closed"] += 1
            break
        report["data"] += json.loads(data)[0] == "data"
print(json.dumps(report), flush=True)
os._exit(0)
"""


def _shm_endpoints(pids) -> list[str]:
    """The abstract socket names the processes `pids` listen on for shared memory, as
    /proc/net/unix lists them (less the '@')."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f]
    # Flags 00010000: listening (an accepted connection shows its listener's name too).
    return [
        r[7][1:]
        for r in rows
        if len(r) == 8 and r[6] in inodes and r[3] == "00010000" and r[7].startswith("@mpmd-shm-")
    ]


def test_transfer_ids_are_keyed_by_the_secret():
    key = "61:act1/0"
    plain = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    a, b = key_to_uuid(key, b"a" * 32), key_to_uuid(key, b"b" * 32)
    assert len({plain, a, b}) == 3
    assert a == key_to_uuid(key, b"a" * 32) != key_to_uuid("61:act1/1", b"a" * 32)


@pytest.mark.parametrize("path", ["socket", "shm"])
def test_a_stranger_on_the_data_plane_gets_nothing_and_delays_nothing(tmp_path, workers, path):
    make = lambda: mpmd.Pipeline(mpmd.split(make_gpt(), num_stages=2), models.lm_loss)
    data = batches()
    cluster = workers
    cluster.transport = path
    try:
        trainer = mpmd.Trainer(
            make(), optax.adamw(1e-3), schedule="gpipe", num_microbatches=M, cluster=cluster, run_dir=tmp_path
        )
    finally:
        cluster.transport = "auto"
    attacker, hung = None, True
    try:
        # What a port scan of the host would find (the test reads it instead of scanning),
        # or on the shared-memory path what /proc/net/unix shows of the workers.
        targets = list(cluster._transfer.values()) if path == "socket" else _shm_endpoints(cluster.pids)
        keys = [
            f"{run}:{kind}{k}/{j}" for run in range(12) for kind in ("act", "grad") for k in range(2) for j in range(M)
        ]
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
        script = ATTACKER if path == "socket" else ATTACKER_SHM
        attacker = subprocess.Popen(
            [sys.executable, "-c", script, json.dumps([targets, keys, [BATCH // M, SEQ, D]])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert attacker.stdout.readline().startswith("posted"), "the attacker did not post its pulls"
        losses = []
        stepping = threading.Thread(
            target=lambda: losses.extend(trainer.step(x, y)["loss"] for x, y in data), daemon=True
        )
        stepping.start()
        stepping.join(STEPS_TIMEOUT_S)
        attacker.stdin.write("report\n")
        attacker.stdin.flush()
        report = json.loads(attacker.stdout.readline())
        hung = stepping.is_alive()
        if hung:  # unblock the stolen transfer's receiver: its peers are gone
            for p in cluster.procs:
                p.kill()
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        if not hung:
            trainer.close(close_cluster=False)
    if path == "socket":
        assert report == {"received": 0, "posted": 3 * len(keys) * len(targets)}
    else:  # both workers' endpoints, every attempt refused: no data, no segment
        assert report == {"endpoints": 2, "data": 0, "fds": 0, "closed": 4}
    assert not hung, f"the steps did not finish within {STEPS_TIMEOUT_S} s"
    reference, _ = train_pipeline(make, "gpipe", M, 1, mpmd.InProcessCluster(), data)
    assert losses == reference


@pytest.fixture(scope="module")
def rooted_worker(tmp_path_factory):
    """One `mpmd worker --root <tmp>/root` (started from the repository, so relative paths
    resolve there), attached as a StaticCluster with one buffer "w" on it."""
    base = tmp_path_factory.mktemp("confine")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    token_file = base / "token"
    token_file.write_text("confine-token-0123456789abcdef\n")
    token_file.chmod(0o600)  # workers refuse a token file others may read
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpmd.recipes.cli",
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            str(token_file),
            "--root",
            str(root),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    cluster = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("MPMD_WORKER_READY"), line
        cluster = mpmd.StaticCluster([line.split()[1]], token_file=str(token_file))
        cluster.start(1)
        cluster.put(0, "w", [np.arange(6, dtype=np.float32)])
        yield cluster, root, outside
    finally:
        if cluster is not None:
            cluster.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def refused(call, directory, root):
    with pytest.raises(WorkerError) as e:
        call()
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside this worker's root" in str(e.value) and str(directory) in str(e.value)
    assert os.path.realpath(root) in str(e.value)


def test_save_and_restore_stay_below_the_workers_root(rooted_worker):
    cluster, root, outside = rooted_worker
    victim = outside / "victim.orbax-checkpoint-tmp"
    victim.mkdir()
    (victim / "data").write_text("precious")
    (root / "link").symlink_to(outside)
    (root / "planted.orbax-checkpoint-tmp").symlink_to(victim)
    before = sorted(p.name for p in outside.rglob("*"))
    escapes = [
        outside / "abs",  # absolute, elsewhere
        os.path.relpath(outside / "rel", ROOT),  # relative to the worker's cwd: ../..
        str(root / ".." / "outside" / "dots"),  # through ..
        root / "link" / "sym",  # through a symlink inside the root
        outside / "victim",  # Orbax would clear victim.orbax-checkpoint-tmp
        root / "planted",  # ... which a symlink in the root points at
        root,
    ]  # the root itself (Orbax's tmp lies beside it)
    for directory in escapes:
        refused(lambda: cluster.save(0, {str(directory): ["w"]}), directory, root)
    assert cluster.wait_saves(0) == {}
    assert sorted(p.name for p in outside.rglob("*")) == before, "something was written outside the root"
    assert (victim / "data").read_text() == "precious"

    # Below the root everything works, and a copy of that checkpoint outside is unreadable.
    inside = root / "run" / "checkpoints" / "1" / "stage_0"
    cluster.save(0, {str(inside): ["w"]})
    assert list(cluster.wait_saves(0)) == [os.path.realpath(inside)]
    shutil.copytree(inside, outside / "copy")
    for directory in (outside / "copy", root / "link" / "copy"):
        refused(lambda: cluster.restore(0, {str(directory): ["w"]}), directory, root)
    cluster.put(0, "w", [np.zeros(6, np.float32)])
    cluster.restore(0, {str(inside): ["w"]})
    np.testing.assert_array_equal(cluster.get(0, ["w"])["w"][0], np.arange(6, dtype=np.float32))


def test_a_local_cluster_refuses_a_run_dir_outside_its_root(tmp_path):
    cluster = mpmd.LocalCluster(num_workers=1, root=str(tmp_path / "runs"))
    try:
        with pytest.raises(ValueError, match=r"confined to .*runs, which does not hold .*elsewhere"):
            cluster.start(1, root=str(tmp_path / "elsewhere"))
        assert cluster.pids == []  # refused before anything started
        cluster.start(1, root=str(tmp_path / "runs" / "a"))
        with pytest.raises(ValueError, match="confined to"):
            cluster.start(1, root=str(tmp_path))
    finally:
        cluster.close()


def test_setup_needs_a_session_secret_and_never_echoes_it(rooted_worker):
    cluster, _, _ = rooted_worker
    setup = {"slice_index": 0, "transfer_host": "127.0.0.1"}
    for secret in (None, "zz-not-hex-zz-not-hex-zz-not-hex", "ab" * 8 + "c", "abcd" * 4, 987654321987):
        with pytest.raises(WorkerError) as e:
            cluster.clients[0].call("Setup", setup if secret is None else {**setup, "transfer_secret": secret})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'transfer_secret' must be" in str(e.value)
        assert secret is None or str(secret) not in str(e.value)
    with pytest.raises(WorkerError) as e:  # a data plane it does not have: refused before anything is touched
        cluster.clients[0].call("Setup", {**setup, "transfer_secret": "ab" * 16, "transport": "rdma"})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "transport must be one of auto, socket, shm" in str(e.value) and "'rdma'" in str(e.value)
    cluster.get(0, ["w"])  # the session it was set up with is untouched


def test_an_encoded_plan_is_checked_by_the_worker_before_anything_is_installed(rooted_worker):
    from mpmd.runtime.worker import streams
    from mpmd.runtime.wire import format as wire
    from mpmd.runtime.worker.instructions import Copy, Delete

    cluster, _, _ = rooted_worker
    # A plan over templates with fields, shipped as bytes: the worker expands it and runs it.
    plan = streams.PackedStream(
        [Copy("w", "c{k}/{j}"), Delete("c{k}/{j}")], [0, 0, 1], [3, 4, 4], [1, 1, 1], [0] * 3, [0] * 3, [-1] * 3
    )
    cluster.install_plan(0, "copies", plan)
    cluster.run("copies", 1, {}, {0: ("c3/1",)})
    np.testing.assert_array_equal(cluster.get(0, ["c3/1"])["c3/1"][0], np.arange(6, dtype=np.float32))
    with pytest.raises(WorkerError, match="no buffer"):
        cluster.get(0, ["c4/1"])  # copied, then deleted by the plan
    # Malformed bytes are refused as a bad request, naming what is wrong; nothing installed.
    bad = plan.with_templates(lambda t: t._replace(dst="c{k.__class__}") if isinstance(t, Copy) else t)
    for payload, match in (
        (b"MPMDSTR1" + bytes(4), "must start with the magic"),
        (bad.to_bytes(), r"names field \{k.__class__\}"),
        (plan.to_bytes()[:-3], "bytes of columns"),
    ):
        b = wire.Builder()
        with pytest.raises(WorkerError, match=match) as e:
            cluster.clients[0].call("InstallPlan", {"name": "bad", "encoded": b.add(payload)}, b.blobs)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(StepFailed, match=r"no plan 'bad'; installed: \['copies'\]"):
        cluster.run("bad", 2, {}, {})
