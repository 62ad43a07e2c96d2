"""A run's layout, checked: one pure function from what a run asks for to where everything
lies.

    run = run_layout(pipeline, optimizer, schedule="interleaved-1f1b", num_microbatches=8,
                     mesh=mpmd.Mesh({"data": 2}, rules={"embed": None}))
    run.schedule, run.meshes, run.layout     # the schedule built, each slice's mesh, every
                                             # stage's parameter and optimizer-state layouts

What it checks, before any worker starts: the schedule fits the pipeline (a name built with
its counts, or a Schedule given as data), each slice's mesh shape, the logical-axis rules,
that every mesh axis divides the dimensions it splits, and that fsdp_gather="per_step" has
something to gather. The Trainer calls it (or takes one already made, `layout=`), and so do
the recipe's config check and dry run (mpmd/recipes/run/build.py `check_layout`) and through
the Trainer the tuner's confirmation runs: one rule for all of them.
"""

from __future__ import annotations

import dataclasses

from mpmd.lowering import core as lowering
from mpmd.schedules import core as schedules
from mpmd.schedules import timeline
from mpmd.stages import gather, sharding


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Each slice's devices and how state is split over them, as the config's `mesh` section
    says. `shape`: None (one device per slice, or the cluster's devices on the data axis),
    one shape for every slice ({"data": 2, "tensor": 2}) or a list of one per slice;
    `rules`: logical axis -> mesh axis (or None: replicated) over mpmd's own rules
    (mpmd/stages/sharding.py); `fsdp_gather`: "per_microbatch" or "per_step", where FSDP-
    sharded weights are gathered (mpmd/stages/gather.py; per_step needs a slice with
    fsdp > 1). `mpmd.Trainer(mesh={"data": 2})` is `mesh=mpmd.Mesh({"data": 2})`."""

    shape: dict | list | tuple | None = None
    rules: dict | None = None
    fsdp_gather: str = gather.PER_MICROBATCH

    def __post_init__(self):
        if self.shape is not None and not isinstance(self.shape, (dict, list, tuple, sharding.SliceMesh)):
            raise ValueError(
                f"mesh shape must be None, a dict of axis sizes (e.g. {{'data': 2}}) or a list "
                f"of one per slice, got {type(self.shape).__name__}"
            )
        if self.rules is not None and not isinstance(self.rules, dict):
            raise ValueError(
                f"rules must be a dict of logical axis -> mesh axis or None (e.g. {{'embed': None}}), "
                f"got {type(self.rules).__name__}"
            )
        gather.check_mode(self.fsdp_gather)

    @classmethod
    def of(cls, mesh) -> Mesh:
        """`mesh` itself when it is a Mesh, else the Mesh of that shape."""
        return mesh if isinstance(mesh, Mesh) else cls(shape=mesh)


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """A checked layout: `schedule` (stages -> slices and the order of tasks) and `layout`
    (each slice's mesh and every stage's state laid out on it)."""

    schedule: schedules.Schedule
    layout: lowering.Layout

    @property
    def meshes(self) -> tuple:
        """One SliceMesh per slice (the layout's)."""
        return tuple(self.layout.meshes)

    @property
    def placement(self) -> tuple[int, ...]:
        """stage -> slice"""
        return self.schedule.placement

    def check_devices(self, devices_per_slice: int | None) -> None:
        """LayoutError naming the slice whose mesh does not use exactly `devices_per_slice`
        devices (a cluster's; None: not known, nothing to check)."""
        sharding.slice_meshes(self.layout.meshes, len(self.layout.meshes), devices_per_slice)


def run_layout(
    pipeline,
    optimizer,
    schedule: str | schedules.Schedule = "1f1b",
    num_microbatches: int | None = None,
    virtual_stages: int | None = None,
    mesh: Mesh | dict | list | None = None,
    devices_per_slice: int | None = None,
) -> RunLayout:
    """The run's checked layout (module docstring). ValueError naming what does not fit: the
    schedule and its counts, or (LayoutError) a mesh shape, a rule, a parameter a mesh axis
    does not divide, per_step gathering with nothing to gather. `devices_per_slice`: the
    cluster's, which every slice's mesh must use (None: any)."""
    m = Mesh.of(mesh)
    built = _schedule(schedule, pipeline.num_stages, num_microbatches, virtual_stages)
    meshes = sharding.slice_meshes(m.shape, built.num_slices, devices_per_slice)
    lay = lowering.layout(pipeline, optimizer, meshes, built.placement, sharding.check_rules(m.rules), m.fsdp_gather)
    lowering.check_gather(lay, built.placement)
    return RunLayout(built, lay)


def _schedule(schedule, num_stages: int, num_microbatches, virtual_stages) -> schedules.Schedule:
    """The validated schedule: built by name, or a Schedule given as data (its own placement),
    which must fit the pipeline and agree with any counts also given."""
    if isinstance(schedule, schedules.Schedule):
        for field, given in (("num_microbatches", num_microbatches), ("virtual_stages", virtual_stages)):
            if given is not None and given != getattr(schedule, field):
                raise ValueError(
                    f"{field}={given!r} disagrees with the given schedule's "
                    f"{field}={getattr(schedule, field)}; leave it out"
                )
        if schedule.num_stages != num_stages:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.num_stages} stages, the pipeline has {num_stages}"
            )
        timeline.validate(schedule)
        return schedule
    num_microbatches = 1 if num_microbatches is None else num_microbatches
    if virtual_stages is None:
        virtual_stages = schedules.default_virtual_stages(schedule) if isinstance(schedule, str) else 1
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if not isinstance(virtual_stages, int) or virtual_stages < 1 or num_stages % virtual_stages:
        raise ValueError(
            f"num_stages ({num_stages}) must be divisible by virtual_stages ({virtual_stages}); "
            f"allowed virtual_stages: {[v for v in range(1, num_stages + 1) if num_stages % v == 0]}"
        )
    built = schedules.make(schedule, num_stages, num_microbatches, virtual_stages)
    timeline.validate(built)
    return built
