"""mpmd: MPMD pipeline-parallel training of JAX/Flax models under a single controller.

The public names load on first use (PEP 562), so `import mpmd.schedules` and
`mpmd schedule ...` (schedules, simulator, renderer: pure Python) never import JAX.
"""

from __future__ import annotations

import importlib
import importlib.util

# public name -> the module that defines it
_WHERE = {
    "abstract": "mpmd.stages.abstract",
    "Pipeline": "mpmd.stages.pipeline",
    "Trainer": "mpmd.train.trainer",
    "Checkpointing": "mpmd.train.options",
    "Recovery": "mpmd.train.options",
    "Mesh": "mpmd.train.layout",
    "split": "mpmd.stages.split",
    "stage_boundary": "mpmd.stages.marks",
    "add_loss": "mpmd.stages.losses",
    "collect_losses": "mpmd.stages.losses",
    "tune": "mpmd.tuner.core",
    "InProcessCluster": "mpmd.runtime.control.inprocess",
    "LocalCluster": "mpmd.runtime.launchers.local",
    "RayCluster": "mpmd.runtime.launchers.ray",
    "StaticCluster": "mpmd.runtime.launchers.static",
    "Rewound": "mpmd.train.checkpoints",
    "NonFinite": "mpmd.train.checkpoints",
    "WorkerLost": "mpmd.runtime.control.cluster",
    "constrain": "mpmd.stages.constraints",
    "Groups": "mpmd.groups.client",
}

__all__ = [
    "abstract",
    "Pipeline",
    "Trainer",
    "Checkpointing",
    "Recovery",
    "Mesh",
    "split",
    "stage_boundary",
    "add_loss",
    "collect_losses",
    "tune",
    "InProcessCluster",
    "LocalCluster",
    "RayCluster",
    "StaticCluster",
    "Rewound",
    "NonFinite",
    "WorkerLost",
    "constrain",
    "Groups",
]


def __getattr__(name: str):
    if name not in _WHERE:
        # A submodule used as an attribute (`mpmd.schedules.gpipe` after `import mpmd`).
        if name.isidentifier() and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'mpmd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
