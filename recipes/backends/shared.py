"""cluster.backend='shared': slices leased from a persistent cluster (`mpmd cluster up`),
found by its cluster file or its manager's address and submit token."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field

from mpmd.recipes.config import Config, WorkerSection, address_problem
from mpmd.recipes.registry import BackendSpec, register_backend_spec


class SharedSection(WorkerSection):
    backend: Literal["shared"] = Field("shared", description="where the slices run")
    address: str | None = Field(
        None, description="the manager's 'host:port' (with token_file holding the submit token)"
    )
    file: str | None = Field(
        None,
        description="the cluster file `mpmd cluster up` wrote (manager address and submit "
        "token); null = ./mpmd-cluster.json unless cluster.address is given",
    )
    share: bool = Field(
        False,
        description="time-share workers with other sharing jobs (each job's results stay "
        "its own); false = wait for workers nobody else uses",
    )
    lease_s: float | None = Field(
        None,
        gt=2,
        le=3600,
        allow_inf_nan=False,
        description="a job silent this long (its controller died) loses its lease: its sessions "
        "and buffers are freed and its workers go back to the pool; null = the cluster's "
        "(`mpmd cluster up --lease-s`, default 10 s)",
    )


def _problems(cfg: Config) -> list[str]:
    cl = cfg.cluster
    out = []
    if cl.file is not None and cl.address is not None:
        out.append(
            "cluster.backend='shared' takes cluster.file (the cluster file) or cluster.address "
            "(the manager's 'host:port', with cluster.token_file), not both"
        )
    if cl.address is not None:
        problem = address_problem("cluster.address", cl.address, "the manager's ")
        out += [problem] if problem else []
        if not cl.token_file:
            out.append(
                "cluster.backend='shared' with cluster.address needs cluster.token_file (a file holding "
                "the cluster's submit token; or give cluster.file instead)"
            )
    elif cl.token_file:
        out.append(
            "cluster.token_file with cluster.backend='shared' is the submit token for cluster.address; "
            "without cluster.address the cluster file holds it: drop cluster.token_file"
        )
    if cl.num_workers is not None:
        out.append(
            "cluster.num_workers is not used by cluster.backend='shared' (the cluster's workers are "
            "`mpmd cluster up --workers N`): set it to null"
        )
    return out


def _build(cfg: Config, timeouts: dict):
    """A job on the shared cluster of cluster.file (or cluster.address + token_file), named
    after its run_dir; its place in the queue is printed on stderr while it waits."""
    from mpmd.runtime.launchers.shared import DEFAULT_CLUSTER_FILE, SharedCluster
    from mpmd.runtime.worker.main import read_token_file

    c = cfg.cluster
    if c.address is not None:
        where = dict(
            address=c.address, submit_token=read_token_file(c.token_file, False, "cluster.token_file", "chmod 600")
        )
    else:
        where = dict(cluster_file=c.file or DEFAULT_CLUSTER_FILE)

    def on_wait(position: int) -> None:
        print(f"waiting for the shared cluster: position {position} in its queue", file=sys.stderr, flush=True)

    return SharedCluster(
        **where, name=Path(cfg.run_dir).name, share=c.share, lease_s=c.lease_s, on_wait=on_wait, **timeouts
    )


SPEC = register_backend_spec(BackendSpec("shared", SharedSection, build=_build, problems=_problems))
