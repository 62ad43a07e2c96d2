"""mpmd: MPMD pipeline-parallel training of JAX/Flax models under a single controller."""
from mpmd.lazy import abstract
from mpmd.pipeline import Pipeline
from mpmd.split import split
from mpmd.trainer import Trainer
from runtime.client import StaticCluster
from runtime.inprocess import InProcessCluster
from runtime.local import LocalCluster

__all__ = ["abstract", "Pipeline", "Trainer", "split", "InProcessCluster", "LocalCluster", "StaticCluster"]
