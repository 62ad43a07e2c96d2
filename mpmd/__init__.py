"""mpmd: MPMD pipeline-parallel training of JAX/Flax models under a single controller.

The public names load on first use (PEP 562), so `import mpmd.schedules` and
`mpmd schedule ...` (schedules, simulator, renderer: pure Python) never import JAX.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

# public name -> the module that defines it
_WHERE = {
    "abstract": "mpmd.lazy",
    "Pipeline": "mpmd.pipeline",
    "Trainer": "mpmd.trainer",
    "split": "mpmd.split",
    "stage_boundary": "mpmd.marks",
    "tune": "mpmd.tune",
    "InProcessCluster": "runtime.inprocess",
    "LocalCluster": "runtime.local",
    "RayCluster": "runtime.ray_cluster",
    "StaticCluster": "runtime.client",
    "Rewound": "mpmd.checkpoints",
    "WorkerLost": "runtime.cluster",
}

__all__ = ["abstract", "Pipeline", "Trainer", "split", "stage_boundary", "tune", "InProcessCluster", "LocalCluster", "RayCluster", "StaticCluster",
           "Rewound", "WorkerLost"]


def __getattr__(name: str):
    if name not in _WHERE:
        # A submodule used as an attribute (`mpmd.schedules.gpipe` after `import mpmd`).
        if name.isidentifier() and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'mpmd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value      # later look-ups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Loading a submodule sets the package attribute of its name (the import system does so
    for every submodule): importing `mpmd.split` would make `mpmd.split` that module. The
    public `mpmd.split` is the function, as when this package imported it eagerly."""

    def __setattr__(self, name, value):
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
