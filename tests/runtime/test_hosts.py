"""Several hosts on one machine (tests/support/netns.py): the controller and the workers in
network namespaces of their own, each with its own address, joined by a bridge.

- The data plane picks its path per pair of slices by host: shared memory between two
  workers of one namespace, sockets between namespaces (abstract Unix sockets, which the
  shared-memory endpoints are, belong to the network namespace); each worker logs the path.
- A worker whose link is cut mid-run is declared lost and replaced by a spare on another
  host; its link is restored while it still runs (a zombie: its lease has not lapsed) and it
  disturbs nothing: the run ends with the losses of an uninterrupted one, every committed
  step names only the new generation's parts, and the zombie leaves once its lease lapses.
- The controller cut off from every worker, with no spare: the static cluster waits for the
  lost worker, takes it back once the link returns, and the run goes on with both slices.
"""

import re
import time

import pytest

from mpmd.recipes.run import run_log
from mpmd.runtime.worker.slice_store import CheckpointStore
from tests.support import netns
from tests.support.processes import Controller, StandaloneWorkers, tiny_gpt_run

pytestmark = pytest.mark.slow  # real worker processes in network namespaces (tests/README.md)

STEPS, EVERY = 16, 4
OVERRIDES = tiny_gpt_run(STEPS, EVERY)
LEASE_S = 15.0  # the cut-off worker's: it is still running when its link comes back


@pytest.fixture(autouse=True)
def _root():
    netns.skip_unless_root()


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run_log.read(run_dir)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The same run on local workers, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("hosts") / "reference"
    Controller(run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES]).succeed()
    return losses(run_dir)


def static(workers, slices: list[int], spares: list[int] = (), **cluster) -> list[str]:
    """The overrides of a static cluster of workers `slices` (then `spares`), by index."""
    quote = lambda idx: "[" + ",".join(f'"{workers.addresses[i]}"' for i in idx) + "]"
    return [
        "cluster.backend=static",
        f"pipeline.num_stages={len(slices)}",
        f"cluster.addresses={quote(slices)}",
        f"cluster.spares={quote(spares)}",
        f"cluster.token_file={workers.root.parent / 'token'}",
        *(f"cluster.{k}={v}" for k, v in cluster.items()),
    ]


def paths_logged(log: str) -> dict[tuple[int, int], str]:
    """{(receiving slice, sending slice): "shared memory" | "sockets"} from a worker's log."""
    found = re.findall(r"slice (\d+) receives from slice (\d+) through (shared memory|sockets)", log)
    return {(int(a), int(b)): how for a, b, how in found}


def test_shared_memory_within_a_host_and_sockets_between_hosts(tmp_path, reference):
    """Host 0: the controller; host 1: the workers of slices 0 and 1; host 2: slice 2's. The
    transfers between slices 0 and 1 go through shared memory, those between 1 and 2 through
    sockets, and the run's losses are the local run's."""
    with netns.Hosts(3) as hosts:
        with StandaloneWorkers(tmp_path, 3, shared=False, hosts=hosts, on=[1, 1, 2]) as workers:
            run_dir = workers.root / "run"
            prefix = ["ip", "netns", "exec", hosts.names[0]]
            three = Controller(
                run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES, *static(workers, [0, 1, 2])], prefix=prefix
            )
            three.succeed()
            paths = {}
            for log in workers.logs:
                paths.update(paths_logged(log.read_text()))
    assert paths[1, 0] == paths[0, 1] == "shared memory", paths
    assert paths[2, 1] == paths[1, 2] == "sockets", paths
    got = losses(run_dir)
    assert sorted(got) == sorted(reference) and all(abs(got[s] - reference[s]) < 1e-6 for s in got), (got, reference)


def test_a_worker_cut_off_is_replaced_and_once_back_disturbs_nothing(tmp_path, reference):
    """Host 0: the controller; hosts 1 and 2: the slices; host 3: a spare. Host 2's link is cut
    after step 6; slice 1 is declared lost (failure_timeout_s=2) and the spare takes it from
    the last checkpoint. Host 2 comes back after step 12, its worker still running in the old
    generation. The run ends with the uninterrupted run's losses; every committed step's
    parts are the new generation's; the cut-off worker leaves on its own."""
    with netns.Hosts(4) as hosts:
        with StandaloneWorkers(tmp_path, 3, shared=False, hosts=hosts, on=[1, 2, 3], lease_s=LEASE_S) as workers:
            run_dir = workers.root / "run"
            run = Controller(
                run_dir,
                ["configs/gpt_tiny.yaml", *OVERRIDES, *static(workers, [0, 1], [2], failure_timeout_s=2)],
                prefix=["ip", "netns", "exec", hosts.names[0]],
            )
            run.wait_for_step(6)
            hosts.cut(2)
            cut_at = time.monotonic()
            run.wait_for_step(12, timeout_s=120)
            hosts.restore(2)
            back_after = time.monotonic() - cut_at
            out = run.succeed()
            zombie = workers.procs[1]
            assert zombie.poll() is None or back_after < LEASE_S, "the cut-off worker left before its link came back"
            assert zombie.wait(timeout=LEASE_S + 30) == 0
            log = workers.logs[1].read_text()
            assert "controller silent" in log
    assert "lost" in out, out[-3000:]
    got = losses(run_dir)
    assert sorted(got) == sorted(reference) and all(got[s] == reference[s] for s in got), (got, reference)
    store = CheckpointStore(run_dir)
    for step in store.committed():
        parts = {leaf["part"] for leaf in store.manifest(step)["leaves"].values()}
        assert len({p.split(".", 1)[1] for p in parts}) == 1, parts  # one generation per step
        if step > 4:  # after the replacement: not the first generation
            assert all(not p.split(".", 1)[1].startswith("g1-") for p in parts), (step, parts)


def test_the_controller_cut_off_from_every_worker_waits_then_goes_on_with_them(tmp_path, reference):
    """Host 0 (the controller) loses its link for 4 s after step 6, with no spare: every slice
    falls silent, the first is declared lost (failure_timeout_s=2), and with nothing else to
    hand out the static cluster waits for the lost worker to answer again
    (cluster.replace_timeout_s), takes it back in a new generation, restores and replays.
    Both workers serve to the end, the run keeps its two slices, its losses are the
    uninterrupted run's."""
    with netns.Hosts(3) as hosts:
        with StandaloneWorkers(tmp_path, 2, shared=False, hosts=hosts, on=[1, 2], lease_s=LEASE_S) as workers:
            run_dir = workers.root / "run"
            run = Controller(
                run_dir,
                ["configs/gpt_tiny.yaml", *OVERRIDES, *static(workers, [0, 1], failure_timeout_s=2)],
                prefix=["ip", "netns", "exec", hosts.names[0]],
            )
            run.wait_for_step(6)
            hosts.cut(0)
            time.sleep(4)
            hosts.restore(0)
            out = run.succeed()
            assert [p.wait(timeout=10) for p in workers.procs] == [0, 0]
            # Both served to the end: the controller shut them down, neither left on its own.
            assert all("shutting down: controller asked" in log.read_text() for log in workers.logs)
            assert "answers again" in run.stderr_path.read_text()
    assert "recovered" in out and "continuing on 1 slice" not in out, out[-3000:]
    got = losses(run_dir)
    assert sorted(got) == sorted(reference) and all(got[s] == reference[s] for s in got), (got, reference)
