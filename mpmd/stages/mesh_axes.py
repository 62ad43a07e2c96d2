"""What a slice's mesh is named by, without JAX: its axes (defined once, in the runtime that
binds them to devices) and what a sharding rule may map a logical axis to. mpmd.stages.sharding
lays arrays out with these; the recipe's config checks mesh.rules against them before JAX is
imported."""

from __future__ import annotations

from typing import Any

from mpmd.runtime.worker.mesh import AXES

__all__ = ["AXES", "rule_problem"]


def rule_problem(logical: Any, target: Any, where: str) -> str | None:
    """None when `target` (a rule for logical axis `logical`) is a mesh axis, a list of them or
    None (replicated); else the sentence saying so, naming the rule as `where`."""
    targets = [] if target is None else [target] if isinstance(target, str) else target
    if isinstance(logical, str) and isinstance(targets, (list, tuple)) and all(t in AXES for t in targets):
        return None
    return (
        f"{where}={target!r}: a rule maps a logical axis name to a mesh axis ({', '.join(AXES)}), "
        f"a list of them, or null (replicated)"
    )
