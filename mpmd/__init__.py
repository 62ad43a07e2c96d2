"""mpmd: MPMD pipeline-parallel training of JAX/Flax models under a single controller."""
from mpmd.checkpoints import Rewound
from mpmd.lazy import abstract
from mpmd.marks import stage_boundary
from mpmd.pipeline import Pipeline
from mpmd.split import split
from mpmd.trainer import Trainer
from runtime.client import StaticCluster, WorkerLost
from runtime.inprocess import InProcessCluster
from runtime.local import LocalCluster
from runtime.ray_cluster import RayCluster

__all__ = ["abstract", "Pipeline", "Trainer", "split", "stage_boundary", "InProcessCluster", "LocalCluster", "RayCluster", "StaticCluster",
           "Rewound", "WorkerLost"]
