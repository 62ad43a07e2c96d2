"""cluster.backend='static': workers started elsewhere (`mpmd worker --listen HOST:PORT`),
listed by address, with spares that replace lost ones."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mpmd.recipes.config import Config, WorkerSection, address_problem
from mpmd.recipes.registry import BackendSpec, register_backend_spec


class StaticSection(WorkerSection):
    backend: Literal["static"] = Field("static", description="where the slices run")
    addresses: list[str | list[str]] = Field(
        [],
        description="one 'host:port' per worker; with gangs, one list per slice of its processes' "
        "'host:port' (process 0 first), or a flat list cut by processes_per_slice",
    )
    spares: list[str | list[str]] = Field(
        [],
        description="extra 'host:port' workers (or gangs, as addresses), each replacing one lost "
        "worker (without spares a static run cannot recover)",
    )


def _flat(entries) -> list[str]:
    return [a for g in entries for a in (g if isinstance(g, list) else [g])]


def _problems(cfg: Config) -> list[str]:
    from mpmd.runtime.worker import gang

    cl, num_slices = cfg.cluster, cfg.num_workers
    out = []
    # Gangs (runtime/worker/gang.py): addresses grouped per slice, as lists or cut by processes_per_slice.
    ganged = cl.processes_per_slice > 1 or any(isinstance(a, list) for a in cl.addresses + cl.spares)
    num_slots = len(cl.addresses)
    if ganged:
        for key in ("addresses", "spares"):
            try:
                slots = gang.group_addresses(getattr(cl, key), cl.processes_per_slice) if getattr(cl, key) else []
            except ValueError as e:
                out.append(f"cluster.{key}: {e}")
                slots = None
            if key == "addresses":
                num_slots = len(slots) if slots is not None else num_slices
    if num_slots != num_slices:
        out.append(
            f"cluster.backend='static' needs cluster.addresses with one 'host:port' per worker "
            f"({num_slices}), got {num_slots}"
            if not ganged
            else f"cluster.backend='static' needs cluster.addresses with one gang (the 'host:port' of each "
            f"of its processes) per slice ({num_slices}), got {num_slots}"
        )
    if cl.hot_spares > len(cl.spares) and not ganged:
        out.append(
            f"cluster.hot_spares={cl.hot_spares} needs as many workers in cluster.spares (the hot spares "
            f"are the first of them), got {len(cl.spares)}"
        )
    if not cl.token_file:
        out.append("cluster.backend='static' needs cluster.token_file (the secret the workers were started with)")
    for key in ("addresses", "spares"):
        out += [p for a in _flat(getattr(cl, key)) if (p := address_problem(f"cluster.{key} entry", a))]
    flat = _flat(cl.addresses + cl.spares)
    twice = sorted({a for a in flat if flat.count(a) > 1})
    if twice:
        out.append(
            f"cluster.addresses and cluster.spares list {', '.join(twice)} more than once: "
            f"each worker serves one slice or waits as one spare"
        )
    return out


def _build(cfg: Config, timeouts: dict):
    import mpmd

    c = cfg.cluster
    # The spares follow the slices' addresses (StaticLauncher).
    return mpmd.StaticCluster(
        c.addresses + c.spares, token_file=c.token_file, processes_per_slice=c.processes_per_slice, **timeouts
    )


SPEC = register_backend_spec(BackendSpec("static", StaticSection, build=_build, gangs=True, problems=_problems))
