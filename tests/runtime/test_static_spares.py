"""A static cluster recovers on a spare address: workers started by hand (`mpmd worker --listen
--token-file --root`), one SIGKILLed between steps; the run ends exactly like an uninterrupted
one. And the config's cluster keys reach the cluster objects (`cluster.spares`, `address`,
`resources`, `failure_timeout_s`)."""

import importlib.util
import subprocess
import sys

import pytest

import mpmd
from mpmd.recipes import config
from mpmd.recipes.run import build
from mpmd.runtime.control.cluster import ReplaceUnsupported
from mpmd.runtime.worker.main import READY, cores_for
from tests.support.processes import ROOT, wait_gone
from tests.support.recovery_runs import assert_same_run, data, make_trainer, train

pytestmark = [pytest.mark.slow, pytest.mark.every_jax]  # worker processes or a controller (tests/README.md)

TOKEN = "static-spares-token-0123456789abcdef"


@pytest.fixture
def static_workers(tmp_path):
    """Three `mpmd worker`s confined to tmp_path: ([addresses], [processes], token file)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)  # workers refuse a token file others may read
    procs, addresses = [], []
    try:
        for i in range(3):
            with open(tmp_path / f"worker_{i}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
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
                            str(tmp_path),
                            "--cpus",
                            ",".join(map(str, cores_for(i, 1))),
                        ],
                        cwd=ROOT,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                    )
                )
        for p in procs:
            line = p.stdout.readline()
            assert line.startswith(READY), line
            addresses.append(line.split()[1])
        yield addresses, procs, str(token_file)
    finally:
        for p in procs:
            if p.poll() is None and wait_gone([p.pid], timeout_s=5.0):
                p.kill()  # by its own pid
            p.wait()


@pytest.mark.parametrize("hot_spares", [0, 1], ids=["cold", "hot"])
def test_static_cluster_replaces_a_killed_worker_by_its_spare(static_workers, uninterrupted, tmp_path, hot_spares):
    """Cold: the spare is set up when the loss comes (and compiles in its first step); hot
    (cluster.hot_spares=1): it was warmed with every slice's programs, and compiles nothing."""
    addresses, procs, token_file = static_workers
    process_at = dict(zip(addresses, procs))
    # As `cluster.addresses` (the two slices) + `cluster.spares` (the third) make it.
    cluster = mpmd.StaticCluster(addresses, token_file=token_file, hot_spares=hot_spares)
    killed = []

    def kill_slice_1(i, trainer):
        if i == 5 and not killed:
            victim = process_at[trainer.cluster.clients[1].address]
            victim.kill()  # SIGKILL
            killed.append(victim)

    trainer = make_trainer(cluster, tmp_path / "run")
    try:
        losses, params, rewinds = train(trainer, data(), kill_slice_1)
        assert trainer.cluster.clients[1].address == addresses[2], "slice 1 now runs on the spare"
        compiles = train.compiles[train.compiles.index(None) + 1]
        assert (compiles == 0) == bool(hot_spares), f"{compiles} compiled after the loss"
        assert cluster.spares.promoted == hot_spares
    finally:
        trainer.close()
    assert rewinds == 1 and trainer.restarts == 1
    assert_same_run((losses, params), uninterrupted)
    assert wait_gone([p.pid for p in procs]) == [], "every worker exits when the controller closes"


def test_static_without_spares_still_refuses_to_replace(tmp_path):
    cfg = config.load(
        None,
        [
            "cluster.backend=static",
            "cluster.addresses=['127.0.0.1:7001', '127.0.0.1:7002']",
            f"cluster.token_file={tmp_path / 'token'}",
        ],
    )
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "token").chmod(0o600)
    cluster = build.build_cluster(cfg)
    cluster.launcher.start(2)
    with pytest.raises(ReplaceUnsupported, match="no spare address left"):
        cluster.launcher.replace(1)


def test_config_cluster_keys_reach_the_clusters(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    static = build.build_cluster(
        config.load(
            None,
            [
                "cluster.backend=static",
                "cluster.addresses=['127.0.0.1:7001', '127.0.0.1:7002']",
                "cluster.spares=['127.0.0.1:7003']",
                f"cluster.token_file={token}",
                "cluster.failure_timeout_s=2.5",
                "cluster.transport=socket",
                "cluster.hot_spares=1",
            ],
        )
    )
    assert static.hot_spares == 1
    assert static.launcher.start(2) == ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]
    assert static.launcher.replace(1) == "127.0.0.1:7003"
    assert static.failure_timeout_s == 2.5 and static.transport == "socket"
    local = build.build_cluster(config.load(None, ["cluster.failure_timeout_s=7", "log.level=error"]))
    assert local.failure_timeout_s == 7 and local.launcher.log_level == "error" and local.transport == "auto"
    assert local.hot_spares == 0
    hot = build.build_cluster(config.load(None, ["cluster.hot_spares=2"]))
    assert hot.hot_spares == 2 and hot.launcher.num_workers == 4  # gpt_tiny's 2 slices and 2 spares
    assert build.build_cluster(config.load(None, ["cluster.transport=shm"])).transport == "shm"
    assert build.build_cluster(config.load(None, [])).failure_timeout_s == 5.0  # null: the cluster's default
    if importlib.util.find_spec("ray") is None:
        return
    ray = build.build_cluster(
        config.load(
            None,
            [
                "cluster.backend=ray",
                "cluster.address=auto",
                "cluster.resources={CPU: 1, GPU: 0}",
                "cluster.failure_timeout_s=9",
            ],
        )
    )
    assert ray.launcher.ray_address == "auto" and ray.failure_timeout_s == 9
    assert ray.launcher._actor_options() == {"num_cpus": 1, "num_gpus": 0, "resources": {}}
