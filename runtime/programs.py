"""Programs: what a slice can run. Shipped as data, never as Python code.

Two kinds:
- "exported": a function serialized with `jax.export` on the controller. The worker
  deserializes and compiles it; it needs none of the user's model code.
- "sleep": a synthetic program with a declared duration and output specs. It costs wall
  time without using the CPU, so a schedule can be replayed on the real runtime with
  recorded or declared task costs (a dry run), and scheduling fidelity can be measured on a
  machine whose cores would otherwise distort it.

A loaded program is called as `program(*bundles) -> tuple of bundles`, a bundle being a
tuple of arrays.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from runtime.instructions import Spec


class ProgramSpec(NamedTuple):
    kind: str                                   # "exported" | "sleep"
    data: bytes = b""                           # jax.export serialization, for "exported"
    duration_s: float = 0.0                     # for "sleep"
    outputs: tuple[tuple[Spec, ...], ...] = ()  # output bundle specs, for "sleep"


KINDS = ("exported", "sleep")
Program = Callable[..., tuple]


def exported(fn: Callable, *arg_specs) -> ProgramSpec:
    """Export `fn(*bundles) -> tuple of bundles` for the given abstract argument bundles."""
    exp = jax.export.export(jax.jit(fn))(*arg_specs)
    return ProgramSpec("exported", data=bytes(exp.serialize()))


def sleep(duration_s: float, outputs: tuple[tuple[Spec, ...], ...] = ()) -> ProgramSpec:
    return ProgramSpec("sleep", duration_s=float(duration_s), outputs=tuple(outputs))


def load(spec: ProgramSpec, device: jax.Device) -> Program:
    """Turn a spec into a callable that runs on `device`. Raises ValueError on a bad spec."""
    if spec.kind == "exported":
        try:
            exp = jax.export.deserialize(bytearray(spec.data))
        except Exception as e:  # flatbuffers raises assorted errors on garbage
            raise ValueError(f"program data is not a valid jax.export serialization: {e}") from None
        return jax.jit(exp.call)
    if spec.kind == "sleep":
        if not spec.duration_s >= 0:
            raise ValueError(f"sleep program needs duration_s >= 0, got {spec.duration_s}")
        # Outputs are made once: a synthetic program's outputs carry no information.
        with jax.default_device(device):
            outs = tuple(tuple(jnp.zeros(s.shape, np.dtype(s.dtype)) for s in bundle)
                         for bundle in spec.outputs)

        def run(*_bundles):
            time.sleep(spec.duration_s)
            return outs
        return run
    raise ValueError(f"unknown program kind {spec.kind!r}; allowed: {', '.join(KINDS)}")
