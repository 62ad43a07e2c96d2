"""Schedules as data: tasks, placements, the builders, validation, task arrays, the
timeline and simulator, rendering and `mpmd schedule`. Pure Python: importing it never
imports JAX."""

from mpmd.schedules.core import (
    SCHEDULES,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    Task,
    default_virtual_stages,
    dualpipe_v,
    gpipe,
    interleaved_one_f_one_b,
    make,
    one_f_one_b,
    register_schedule,
    schedule_spec,
    zb_h1,
    zb_v,
)
from mpmd.schedules.timeline import execution_order, validate

__all__ = [
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "Task",
    "default_virtual_stages",
    "dualpipe_v",
    "execution_order",
    "gpipe",
    "interleaved_one_f_one_b",
    "make",
    "one_f_one_b",
    "register_schedule",
    "schedule_spec",
    "validate",
    "zb_h1",
    "zb_v",
]
