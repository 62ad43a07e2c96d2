"""Every JAX API whose spelling differs across the supported range (jax 0.10.2 to 0.12.x),
and the versions a controller and its workers must agree on. Nothing else in the package
imports `jax._src` or `jax.experimental`, or tests a JAX version.

What differs (checked against each release's own source; docs/design.md has the table):
- 0.11.0 merged `ClosedJaxpr` into `Jaxpr` (`ClosedJaxpr` is an alias; a Jaxpr carries
  its consts). `Jaxpr(constvars, invars, ...)` built without consts then turns its
  constvars into leading invars, so `.constvars` is empty and `.invars` longer than asked:
  `new_jaxpr` passes the consts where the class takes them, so `.constvars` and `.invars`
  read the same on every version. `isinstance(j, ClosedJaxpr)` is True for every jaxpr
  there, and an open one's `.consts` is [] and `.jaxpr` itself, so `closed_parts` works
  for both.
- 0.11.2 replaced the `closed_call` primitive by `eval_jaxpr` (same `call_jaxpr` param):
  CALL_PRIMITIVES names both.
- 0.11.2 moved jax.export's serialization to version 12 (0.10.2 writes 11) and records the
  writer's JAX version: one reason programs must not cross versions (`check_versions`).
- By 0.11.2 (the first 0.11 run here) an `AbstractMesh` built without `axis_types` is
  Explicit (0.10.2: Auto), while a `Mesh` over devices stayed Auto; jax.export records the abstract mesh's axis types and
  `Exported.call` refuses a concrete mesh whose types differ ("NamedSharding new mesh ...
  does not match the mesh used for export"). mpmd's programs are written for Auto axes (XLA
  propagates shardings; no sharding-in-types), so every mesh, abstract or bound to devices, is
  built here with Auto named: `mesh`, `abstract_mesh`.
- jaxlib 0.11 removed XLA:CPU's `--xla_cpu_use_fusion_emitters` flag (the MLIR fusion
  emitters became the only ones), and XLA aborts a process whose XLA_FLAGS name a flag it
  does not know: `XLA_CPU_COMPILE_FAST` names it only where it exists.
- jaxlib 0.12 on CPU: a gang (a slice of several processes, collectives over gloo) whose
  processes take a program from JAX's persistent compilation cache hangs in its first
  collective; 0.10.2 and 0.11.2 run the same warm cache, and a two-process psum from a warm
  cache runs on 0.12.1 too, so the trigger is narrower and was not pinned down (JAX writes
  the cache from process 0 only: one process may load what the other compiles).
  `GANG_PERSISTENT_CACHE` says whether a gang may use it (runtime/worker/gang.py turns it
  off where not).
- Unchanged over the range, but private or experimental, so reached only through here:
  `jax._src.interpreters.partial_eval.dce_jaxpr` / `convert_constvars_jaxpr` (0.12 adds a
  `live_inputs` argument, default True: the old behaviour), `jax._src.distributed`'s client,
  and `jax.experimental.transfer` (start_transfer_server, TransferServer.address /
  connect / await_pull / _reset_rendevous_table, TransferConnection.pull: the same names
  and arguments in jaxlib 0.10.2, 0.11.2 and 0.12.0.1).
"""

from __future__ import annotations

import jax
import jaxlib
from jax._src.interpreters.partial_eval import convert_constvars_jaxpr, dce_jaxpr  # noqa: F401  (re-exported)
from jax.experimental import transfer  # noqa: F401  (re-exported: the data plane's API)
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import AbstractMesh, AxisType, Mesh

# jax 0.11.0 and later: one Jaxpr class that carries its consts.
MERGED_JAXPR = ClosedJaxpr is Jaxpr

JAXLIB_VERSION = tuple(int(p) for p in jaxlib.__version__.split(".")[:3] if p.isdigit())

# XLA_FLAGS that make XLA:CPU compile fast rather than compile fast code (what the tests set,
# tests/support/xla.py, never a real run): LLVM at -O0 and, up to jaxlib 0.10, the elemental
# IR emitter for fused kernels in place of the MLIR fusion emitters (jaxlib 0.11 removed the
# flag; naming it there aborts the process: "Unknown flag in XLA_FLAGS").
XLA_CPU_COMPILE_FAST = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if JAXLIB_VERSION < (0, 11) else ""
)

# Primitives that call a jaxpr once, with no differentiation or control flow of their own:
# "closed_call" up to 0.11.1, "eval_jaxpr" from 0.11.2 (the same primitive renamed).
CALL_PRIMITIVES = ("jit", "pjit", "closed_call", "core_call", "eval_jaxpr")


# Whether the processes of a CPU gang may take programs from JAX's persistent compilation
# cache: from jaxlib 0.12 a gang whose processes did (with entries written by an earlier run)
# hung in its first collective (tests/runtime/test_gang.py, seen on 0.12.1; 0.11.2 ran).
GANG_PERSISTENT_CACHE = JAXLIB_VERSION < (0, 12)


def mesh(devices, axis_names) -> Mesh:
    """A Mesh of the array of `devices` with Auto axes, on every version."""
    return Mesh(devices, tuple(axis_names), axis_types=(AxisType.Auto,) * len(axis_names))


def abstract_mesh(axis_sizes, axis_names) -> AbstractMesh:
    """An AbstractMesh with Auto axes, as a program is exported for: from jax 0.11 the default
    is Explicit, which a program then refuses to run on a Mesh bound to devices (Auto)."""
    return AbstractMesh(tuple(axis_sizes), tuple(axis_names), axis_types=(AxisType.Auto,) * len(axis_names))


def versions() -> dict[str, str]:
    """{"jax": ..., "jaxlib": ...}: the versions this process runs. The controller sends its
    own in Setup and each worker compares them with its own (`check_versions`)."""
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


class VersionMismatch(ValueError):
    """A worker runs other JAX or jaxlib versions than its controller."""


def check_versions(controller: dict) -> None:
    """VersionMismatch, in one line naming both sides' versions, unless `controller` (the
    Setup's versions) equals this process's: a program exported by one JAX version is not
    guaranteed to load in another (0.10.2 and 0.11.2 write different serialization
    versions), nor to compute the same bits."""
    here = versions()
    if controller != here:
        raise VersionMismatch(
            f"this worker runs {_describe(here)} but its controller runs {_describe(controller)}; "
            f"install the same jax and jaxlib on the controller and every worker"
        )


def _describe(v: dict) -> str:
    if not isinstance(v, dict) or not all(isinstance(v.get(k), str) for k in ("jax", "jaxlib")):
        return f"unknown versions ({str(v):.80})"
    return f"jax {v['jax']}, jaxlib {v['jaxlib']}"


def new_jaxpr(constvars, invars, outvars, eqns, effects, debug_info, consts) -> Jaxpr:
    """A jaxpr whose `.constvars` are `constvars` (valued `consts`) and `.invars` are `invars`
    on every version. Up to 0.10 the Jaxpr is open and the caller keeps `consts` beside it,
    as before; from 0.11 it carries them too (without them its constvars would become
    invars)."""
    if MERGED_JAXPR:
        return Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, debug_info, consts=list(consts))
    return Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, debug_info)


def closed_parts(body) -> tuple[Jaxpr, list]:
    """(the jaxpr, its consts) of a higher-order primitive's body, closed or open."""
    return (body.jaxpr, list(body.consts)) if isinstance(body, ClosedJaxpr) else (body, [])


def distributed_client():
    """The JAX distributed service's client of this process (after jax.distributed.initialize):
    its key-value store is a gang's agreement channel (runtime/worker/gang.py)."""
    from jax._src import distributed

    return distributed.global_state.client


def reset_transfers(server) -> None:
    """Drop a TransferServer's offers not yet pulled and fail the pulls waiting on it (a
    private method of jaxlib's server, the same name across the range)."""
    server._reset_rendevous_table()
