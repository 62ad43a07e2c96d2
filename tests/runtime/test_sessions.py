"""A shared worker (`mpmd worker --shared`): one session per job, reached only with that job's
credential; admin RPCs for the cluster token only; a silent job's session dropped with its
memory; compiled programs shared between jobs. Two real shared worker processes, real gRPC,
real Orbax on disk; jobs drive them through the ordinary control plane (StaticCluster) with
their credential as the token.
"""

import threading
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpmd
from mpmd.runtime import compat
from mpmd.runtime.worker import instructions
from mpmd.runtime.worker import programs
from mpmd.runtime.wire import format as wire
from mpmd.runtime.control.client import WorkerError
from mpmd.runtime.worker.compile_cache import CompileCache
from mpmd.runtime.wire.credentials import check_job_id, job_credential, job_of
from mpmd.runtime.worker.instructions import Recv, Run, Send, Spec
from tests.support.processes import StandaloneWorkers, wait_gone

pytestmark = pytest.mark.slow  # real worker processes or a controller subprocess (tests/README.md)

B, D = 8, 16
LEASE_S = 1.5  # the lapse test's session lease


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    # No JAX compilation cache on disk: a miss of the worker's own cache compiles for real.
    with StandaloneWorkers(tmp_path_factory.mktemp("shared"), 2, disk_cache=False) as s:
        yield s
    assert wait_gone([p.pid for p in s.procs]) == []


def started(shared, job: str):
    """Job `job`'s control plane on both workers, started (Setup, Connect) as a Trainer would."""
    cluster = shared.job(job)
    cluster.start(2)
    return cluster


def refusal(fn) -> tuple:
    """(status code, message) of the WorkerError `fn()` raises."""
    with pytest.raises(WorkerError) as e:
        fn()
    return e.value.code, str(e.value)


# -- a tiny two-slice program: slice 0's activation goes to slice 1, which updates its weight --
X_SPEC = jax.ShapeDtypeStruct((B, D), np.float32)
W_SPEC = jax.ShapeDtypeStruct((D, D), np.float32)
Y_SPECS = (Spec((B, D), "float32"),)


def first(w, x):
    return ((jnp.tanh(x[0] @ w[0]),),)


def second(w, y):
    z = jnp.tanh(y[0] @ w[0])
    return (z,), (w[0] - 0.1 * y[0].T @ z,)  # the weight moves: state carries across steps


SPECS = {
    "first": programs.exported(first, (W_SPEC,), (X_SPEC,)),
    "second": programs.exported(second, (W_SPEC,), (X_SPEC,)),
}
PLANS = {
    0: [Run("first", ("w0", "x"), ("y",)), Send("y", 1, "y")],
    1: [Recv("y", 0, "y", Y_SPECS), Run("second", ("w1", "y"), ("z", "w1"))],
}
RNG = np.random.default_rng(0)
W0, W1 = (RNG.standard_normal((D, D)).astype(np.float32) / 4 for _ in range(2))
XS = [RNG.standard_normal((B, D)).astype(np.float32) for _ in range(3)]


def train(cluster) -> list[np.ndarray]:
    """Ship the program and plans, put the weights, run 3 steps; slice 1's outputs and weight."""
    for i, stream in PLANS.items():
        cluster.load_programs(i, SPECS)
        cluster.install_plan(i, "step", stream)
    cluster.put(0, "w0", [W0])
    cluster.put(1, "w1", [W1])
    out = [cluster.run("step", step, {0: {"x": [x]}}, {1: ["z"]})[1].fetched["z"][0] for step, x in enumerate(XS)]
    return out + [cluster.get(1, ["w1"])["w1"][0]]


def test_two_sessions_at_once_get_bitwise_what_one_alone_gets(shared):
    alone = started(shared, "alone")
    try:
        expected = train(alone)
    finally:
        alone.close()
    jobs = {name: started(shared, name) for name in ("a", "b")}
    got, errors = {}, []

    def run(name):
        try:
            got[name] = train(jobs[name])
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in jobs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for c in jobs.values():
            c.close()
    assert not errors, errors
    for name in jobs:
        assert len(got[name]) == len(expected)
        for g, e in zip(got[name], expected):
            np.testing.assert_array_equal(g, e)
    # A job's Shutdown (StaticCluster.close) closed its own session and nothing else.
    sessions = shared.admin(0, "Sessions")
    assert not {"alone", "a", "b"} & {s["job"] for s in sessions["sessions"]}
    assert shared.procs[0].poll() is None and shared.procs[1].poll() is None


def test_one_jobs_credential_reaches_only_its_own_session(shared, tmp_path):
    a, b = started(shared, "iso-a"), started(shared, "iso-b")
    try:
        b.put(0, "secret", [np.arange(4, dtype=np.float32)])
        a_raw = shared.client(0, shared.credential("iso-a"))
        a_raw.generation = a.generation  # a's own calls: an older generation would be refused as stale
        # A names B's buffer: its own session has none; its Put and Delete land in its own.
        code, message = refusal(lambda: a_raw.call("Get", {"names": ["secret"]}))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "no buffer" in message
        a.put(0, "secret", [np.zeros(4, np.float32)])
        a.delete(0, ["secret"])
        np.testing.assert_array_equal(b.get(0, ["secret"])["secret"][0], np.arange(4))
        # B's plan is not A's to run; A's Abort does not stop B's run.
        sleep = {"nap": programs.sleep(1.0, ((Spec((4,), "float32"),),))}
        for i in range(2):
            b.load_programs(i, sleep)
            b.install_plan(i, "nap", [Run("nap", (), ("out",))])
        code, message = refusal(lambda: a_raw.call("Run", {"plan": "nap", "run": 7}))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "no plan 'nap'" in message
        pending = b.launch("nap", 7, {}, {0: ["out"]})
        time.sleep(0.3)
        a_raw.call("Abort", {"run": 10**9})
        assert pending.result()[0].fetched["out"][0].shape == (4,)
        # Admin RPCs need the cluster token; the cluster token does not act on a job's session.
        for method, header in (
            ("Sessions", {}),
            ("OpenSession", {"job": "iso-a", "root": str(shared.root / "x")}),
            ("CloseSession", {"job": "iso-b"}),
        ):
            code, message = refusal(lambda: a_raw.call(method, header))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "cluster manager's" in message
            assert shared.logged(0, f"refused {method} from job iso-a ")
        code, _ = refusal(lambda: shared.client(0).call("Get", {"names": ["secret"]}))
        assert code == grpc.StatusCode.PERMISSION_DENIED and shared.logged(0, "refused Get from the manager ")
        # A job without a session here, however valid its credential.
        stranger = shared.client(0, shared.credential("iso-c"))
        code, message = refusal(lambda: stranger.call("Get", {"names": ["secret"]}))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "no session for job iso-c on this worker" in message
        assert shared.logged(0, "refused Get from job iso-c ")
        # The manager closing A's session aborts A's run in flight, and only A's.
        naps = {"nap": programs.sleep(0.5, ((Spec((4,), "float32"),),))}
        a.load_programs(0, naps)
        a.install_plan(0, "naps", [Run("nap", (), ("out",))] * 4)
        running = a_raw.future("Run", {"plan": "naps", "run": 1})
        time.sleep(0.2)
        assert shared.admin(0, "CloseSession", {"job": "iso-a"}) == {"freed": True}
        with pytest.raises(grpc.RpcError) as e:
            running.result(timeout=1.5)  # not the 2 s the plan would take
        assert e.value.code() == grpc.StatusCode.ABORTED
        # B is untouched by all of it.
        np.testing.assert_array_equal(b.get(0, ["secret"])["secret"][0], np.arange(4))
        assert b.run("nap", 8, {}, {1: ["out"]})[1].fetched["out"][0].shape == (4,)
    finally:
        a.close()
        b.close()


def test_a_forged_credential_is_refused_before_anything(shared):
    shared.open("forge-b")
    other_key = job_credential("x" * 32, "forge-b")  # made with the wrong key
    a_mac = shared.credential("forge-a").rpartition(".")[2]
    borrowed = f"job.forge-b.{a_mac}"  # B's name, A's MAC
    near_token = shared.token[:-1] + ("1" if shared.token.endswith("0") else "0")  # one character off
    for credential in (other_key, borrowed, "job.forge-b", near_token):
        code, _ = refusal(lambda: shared.client(0, credential).call("Heartbeat"))
        assert code == grpc.StatusCode.UNAUTHENTICATED, credential
    code, _ = refusal(lambda: _no_token_call(shared))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # A valid credential of a job named like the manager's role is still a job's.
    code, _ = refusal(lambda: shared.client(0, shared.credential("admin")).call("Sessions"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert shared.logged(0, "refused Heartbeat from ") and "wrong token" in shared.logs[0].read_text()
    shared.admin(0, "CloseSession", {"job": "forge-b"})
    shared.admin(1, "CloseSession", {"job": "forge-b"})


def _no_token_call(shared):
    channel = grpc.insecure_channel(shared.addresses[0])
    try:
        channel.unary_unary("/mpmd.Worker/Heartbeat")(b"", timeout=5)
    except grpc.RpcError as e:
        raise WorkerError(shared.addresses[0], e.details(), e.code()) from None
    finally:
        channel.close()


def test_credentials_verify_only_their_own_job():
    token = "k" * 32
    cred = job_credential(token, "job-1")
    assert job_of(cred, token) == "job-1"
    assert job_of(cred, "j" * 32) is None
    assert job_of(cred.replace("job-1", "job-2"), token) is None
    assert job_of(token, token) is None and job_of(None, token) is None
    for bad in ("", "Job", "-x", "a.b", "a" * 65, 7):
        with pytest.raises(ValueError, match="job id must be"):
            check_job_id(bad)


def test_open_session_refuses_what_would_break_confinement(shared, tmp_path):
    bad = [
        ({"job": "Bad!", "root": str(shared.root / "q")}, "job id must be"),
        ({"job": "ok", "root": "relative/dir"}, "absolute directory"),
        ({"job": "ok", "root": str(tmp_path)}, "not below the worker's root"),
        ({"job": "ok", "root": str(shared.root)}, "not below the worker's root"),
        ({"job": "ok", "root": str(shared.root / "q"), "lease_s": 0}, "positive number of seconds"),
    ]
    for header, match in bad:
        code, message = refusal(lambda: shared.admin(0, "OpenSession", header))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and match in message, message
    shared.admin(0, "OpenSession", {"job": "outer", "root": str(shared.root / "outer")})
    try:
        code, message = refusal(
            lambda: shared.admin(0, "OpenSession", {"job": "inner", "root": str(shared.root / "outer" / "in")})
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "overlaps job outer's root" in message
        shared.admin(0, "OpenSession", {"job": "outer", "root": str(shared.root / "outer")})  # idempotent
    finally:
        assert shared.admin(0, "CloseSession", {"job": "outer"}) == {"freed": True}
        assert shared.admin(0, "CloseSession", {"job": "outer"}) == {"freed": False}  # already gone


def test_save_and_restore_stay_inside_the_sessions_root(shared, tmp_path):
    a, b = started(shared, "root-a"), started(shared, "root-b")
    try:
        a.put(0, "w", [np.arange(6, dtype=np.float32)])
        b.put(0, "w", [np.ones(6, np.float32)])
        b_dir = str(shared.root / "root-b" / "ckpt")
        b.save(0, {b_dir: ["w"]})
        b.wait_saves(0)
        before = sorted(p.relative_to(shared.root) for p in shared.root.rglob("*"))
        for directory in (str(shared.root / "root-b" / "mine"), str(shared.root / "elsewhere"), str(tmp_path / "x")):
            code, message = refusal(lambda: a.save(0, {directory: ["w"]}))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside job root-a's root" in message, message
        code, message = refusal(lambda: a.restore(0, {b_dir: ["w"]}))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside job root-a's root" in message
        assert shared.logged(0, "refused Save from job root-a ") and shared.logged(
            0, "refused Restore from job root-a "
        )
        assert sorted(p.relative_to(shared.root) for p in shared.root.rglob("*")) == before
        # Inside its own root a job saves and restores as any controller does.
        a_dir = str(shared.root / "root-a" / "ckpt")
        a.save(0, {a_dir: ["w"]})
        a.wait_saves(0)
        a.put(0, "w", [np.zeros(6, np.float32)])
        a.restore(0, {a_dir: ["w"]})
        np.testing.assert_array_equal(a.get(0, ["w"])["w"][0], np.arange(6))
    finally:
        a.close()
        b.close()


def test_a_silent_sessions_memory_is_freed_within_its_lease(shared):
    before = shared.admin(1, "Sessions")["live_bytes"]
    shared.admin(1, "OpenSession", {"job": "quiet", "root": str(shared.root / "quiet"), "lease_s": LEASE_S})
    job = shared.client(1, shared.credential("quiet"))
    job.call("Setup", {"slice_index": 0, "transfer_host": "127.0.0.1", "transfer_secret": "ab" * 16})
    big = np.ones((1024, 1024), np.float32)  # 4 MiB
    for n in range(4):
        job.call("Put", {"name": f"b{n}", "arrays": [{"$blob": 0}]}, [big])
    held = shared.admin(1, "Sessions")
    mine = [s for s in held["sessions"] if s["job"] == "quiet"]
    assert mine and mine[0]["buffers"] == 4 and mine[0]["bytes"] == 4 * big.nbytes
    assert held["live_bytes"] >= before + 4 * big.nbytes
    job.close()  # the job goes silent
    deadline = time.monotonic() + LEASE_S + 3.0
    while time.monotonic() < deadline and any(s["job"] == "quiet" for s in shared.admin(1, "Sessions")["sessions"]):
        time.sleep(0.2)
    after = shared.admin(1, "Sessions")
    assert not any(s["job"] == "quiet" for s in after["sessions"]), "the silent job's session outlived its lease"
    print(
        f"\nlive bytes on the worker: {before} before the session, {held['live_bytes']} with it, "
        f"{after['live_bytes']} after its lease lapsed"
    )
    assert abs(after["live_bytes"] - before) <= 0.1 * before, (before, after["live_bytes"])
    assert shared.logged(1, "job quiet silent for")
    code, message = refusal(lambda: shared.client(1, shared.credential("quiet")).call("Heartbeat"))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "no session for job quiet" in message
    assert shared.procs[1].poll() is None, "a job's silence must not stop a shared worker"


def deep(w, x):
    """A program that takes a while to compile (a chain of distinct layers)."""
    h = x[0]
    for i in range(8):
        h = jnp.tanh(h @ w[0] * (1.0 + i / 8) + jnp.sin(h) * i)
    return ((h,),)


def test_a_second_job_loading_the_same_programs_hits_the_cache(shared):
    spec = {"deep": programs.exported(deep, (W_SPEC,), (X_SPEC,))}
    timings, results = [], []
    for job in ("cache-1", "cache-2"):
        shared.open(job)
        client = shared.client(0, shared.credential(job))
        try:
            client.call("Setup", {"slice_index": 0, "transfer_host": "127.0.0.1", "transfer_secret": "cd" * 16})
            stats = shared.admin(0, "Sessions")["cache"]
            t0 = time.perf_counter()
            client.call(
                "LoadPrograms",
                {"programs": [{"name": "deep", "kind": "exported", "data": {"$blob": 0}}]},
                [spec["deep"].data],
            )
            t1 = time.perf_counter()
            client.call("InstallPlan", {"name": "p", "stream": [instructions.to_json(Run("deep", ("w", "x"), ("y",)))]})
            client.call("Put", {"name": "w", "arrays": [{"$blob": 0}]}, [W0])
            t2 = time.perf_counter()
            h, blobs = client.call(
                "Run", {"plan": "p", "run": 0, "feeds": {"x": [{"$blob": 0}]}, "fetch": ["y"]}, [XS[0]]
            )
            t3 = time.perf_counter()
            results.append(wire.blob(blobs, h["fetched"]["y"][0]))
            after = shared.admin(0, "Sessions")["cache"]
            timings.append((t1 - t0, t3 - t2))
            delta = {k: after[k] - stats[k] for k in ("hits", "misses")}
            assert delta == ({"hits": 0, "misses": 1} if job == "cache-1" else {"hits": 1, "misses": 0}), delta
        finally:
            client.close()
            for i in range(2):
                shared.admin(i, "CloseSession", {"job": job})
    np.testing.assert_array_equal(results[0], results[1])
    assert after["programs"] >= 1 and after["bytes"] >= len(spec["deep"].data)
    print(
        f"\nLoadPrograms + first Run of a {len(spec['deep'].data)}-byte program: first job "
        f"{timings[0][0] * 1e3:.1f} + {timings[0][1] * 1e3:.0f} ms, second job (cache hit) "
        f"{timings[1][0] * 1e3:.1f} + {timings[1][1] * 1e3:.0f} ms; first Run ratio "
        f"{timings[0][1] / timings[1][1]:.1f}x"
    )


def test_the_compile_cache_evicts_least_recently_used_under_its_bound():
    mesh = compat.mesh(np.array(jax.devices()[:1]), ("data",))
    specs = [programs.exported(lambda b, k=k: ((b[0] * k,),), (X_SPEC,)) for k in (2.0, 3.0, 4.0)]
    cache = CompileCache(limit_bytes=len(specs[0].data) + len(specs[1].data) + 8)  # room for two
    first = cache.load(specs[0], mesh)
    cache.load(specs[1], mesh)
    assert cache.load(specs[0], mesh) is first  # a hit; specs[1] is now the oldest
    cache.load(specs[2], mesh)  # evicts specs[1]
    assert cache.stats() == {
        "programs": 2,
        "bytes": len(specs[0].data) + len(specs[2].data),
        "limit_bytes": cache.limit_bytes,
        "hits": 1,
        "misses": 3,
        "evictions": 1,
    }
    assert cache.load(specs[0], mesh) is first and cache.load(specs[1], mesh) is not first
    assert (cache.hits, cache.misses) == (2, 4)
    with pytest.raises(ValueError, match="compile cache's limit"):
        CompileCache(limit_bytes=-1)


def test_a_plain_worker_keeps_compiled_programs_across_setups(tmp_path):
    # The cache serves a worker of one controller too: a re-Setup (a restart, a recovery)
    # gets its programs back without compiling them again. Each session's first call of a
    # program reports its signature all the same (what a hot spare is warmed with), and a
    # second call of the same signature reports nothing.
    spec = {"deep": programs.exported(deep, (W_SPEC,), (X_SPEC,))}
    with StandaloneWorkers(tmp_path, 1, shared=False, disk_cache=False) as plain:
        cluster = mpmd.StaticCluster(plain.addresses, token=plain.token)
        try:
            reported, compiles = [], []
            for _ in range(2):
                cluster.start(1)  # a fresh executor: nothing shipped survives
                cluster.load_programs(0, spec)
                cluster.install_plan(0, "p", [Run("deep", ("w", "x"), ("y",))])
                cluster.put(0, "w", [W0])
                for run in range(2):
                    (result,) = cluster.run("p", run, {0: {"x": [XS[0]]}}, {0: ["y"]})
                    reported.append(sorted(result.compiled or {}))
                    compiles.append(result.compiles)
            stats = plain.admin(0, "Sessions")
            # OpenSession is a shared worker's; a plain one says so.
            code, message = refusal(lambda: plain.admin(0, "OpenSession", {"job": "x", "root": str(plain.root / "x")}))
        finally:
            cluster.close()
        assert [s["job"] for s in stats["sessions"]] == [None]
        assert (stats["cache"]["hits"], stats["cache"]["misses"]) == (1, 1), stats["cache"]
        assert reported == [["deep"], [], ["deep"], []], reported
        assert compiles[0] > 0 and compiles[1:] == [0, 0, 0], compiles
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "needs a shared worker" in message
