"""Collectives counted in the compiled programs of one training step's plan: each Run's
program compiled for a slice's mesh, its collectives of the given kinds counted, times the
runs (tests/stages/test_partials.py counts reductions, tests/stages/test_gather.py gathers)."""

import re

import jax

from mpmd.runtime.worker import programs
from mpmd.runtime.worker.instructions import Run
from mpmd.stages import names

REDUCTIONS = ("all-reduce", "reduce-scatter")
GATHERS = ("all-gather",)
_ARRAY = re.compile(r"\w+\[(\d[\d,]*)\]")  # an array type with at least one dimension


def collective_arrays(hlo: str, ops) -> int:
    """How many non-scalar arrays the compiled program's collectives of kinds `ops` move (XLA
    combines several into one tuple-shaped op: each element counts)."""
    pattern = re.compile(r"= (.*?) (" + "|".join(map(re.escape, ops)) + r")(?:-start)?\(")
    return sum(len(_ARRAY.findall(result)) for result, _ in pattern.findall(hlo))


def compile_program(spec, mesh):
    """An exported program compiled for `mesh` (the slice's devices), on arguments laid out as
    it takes them: what a worker runs, to read its HLO or its output shardings."""
    exp = jax.export.deserialize(bytearray(spec.data))
    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exp.in_avals, exp.in_shardings_jax(mesh))
    ]
    bundles, _ = jax.tree.unflatten(exp.in_tree, args)
    return programs.load(spec, mesh).lower(*bundles).compile()


def step_collectives(lowered, r: int, mesh, ops) -> dict[str, int]:
    """Per program kind, the arrays slice r's training plan moves by collectives of kinds
    `ops` in one step (kinds with none left out)."""
    counts: dict[str, int] = {}
    compiled: dict[str, int] = {}
    for ins in lowered.train[r]:
        if not isinstance(ins, Run):
            continue
        if ins.program not in compiled:
            hlo = compile_program(lowered.programs[r][ins.program], mesh).as_text()
            compiled[ins.program] = collective_arrays(hlo, ops)
        kind = names.parse_program(ins.program).kind
        counts[kind] = counts.get(kind, 0) + compiled[ins.program]
    return {k: n for k, n in counts.items() if n}
