"""How the same-host data plane's bytes cross between device and host memory (runtime/wire/
shm.py, its docstring's Host staging): on CPU no staging (a device array is host memory); on
an accelerator through pinned host memory on both ends, with a fallback to pageable."""

from __future__ import annotations

import logging

import jax
import numpy as np

log = logging.getLogger("mpmd.worker")

HOST_STAGINGS = ("auto", "pinned", "pageable")


class Staging:
    """How one worker's shared-memory transfers cross between device and host memory:
    `Staging.of(devices, "auto" | "pinned" | "pageable")`. Under
    auto, a copy through pinned memory that fails (a platform or jaxlib whose pinned host
    memory cannot take it) is logged once and the worker stages pageable from then on, the
    transfer included; a forced "pinned" fails the transfer instead."""

    def __init__(self, pinned: bool, forced: bool = False):
        self.pinned, self.forced = pinned, forced

    @classmethod
    def of(cls, devices, staging: str = "auto") -> "Staging":
        """auto: pinned where the devices are not CPUs and every one has a "pinned_host"
        memory; pinned: always (ValueError where a device has none); pageable: never."""
        if staging not in HOST_STAGINGS:
            raise ValueError(f"host staging must be one of {', '.join(HOST_STAGINGS)}, got {staging!r:.50}")
        if staging == "pageable":
            return cls(False)
        devices = list(devices)
        lacking = [d for d in devices if "pinned_host" not in {m.kind for m in d.addressable_memories()}]
        if staging == "pinned" and lacking:
            raise ValueError(
                f"host staging 'pinned': device {lacking[0]} has no pinned host memory "
                f"(its memories: {', '.join(m.kind for m in lacking[0].addressable_memories())}); "
                f"use auto or pageable"
            )
        return cls(
            staging == "pinned" or (not lacking and any(d.platform != "cpu" for d in devices)),
            forced=staging == "pinned",
        )

    def _give_up(self, error: Exception) -> None:
        if self.forced:
            raise error
        if self.pinned:
            self.pinned = False
            log.warning(
                "shared-memory transfers stage through pageable host memory from now on: a copy "
                "through pinned host memory failed (%s: %s)",
                type(error).__name__,
                error,
            )

    def to_host(self, array: jax.Array) -> np.ndarray:
        """The bytes of `array` on the host, for copying into a segment: from a pinned-host
        copy of it when pinned (numpy views that copy in place where jaxlib allows)."""
        if self.pinned:
            try:
                return np.asarray(jax.device_put(array, array.sharding.with_memory_kind("pinned_host")))
            except Exception as e:
                self._give_up(e)
        return np.asarray(array)

    def to_device(self, view: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        """An array laid out as `sharding` from `view` (a piece of a segment): pageable, on
        CPU it may alias the segment (and so keeps the segment's exporter alive); pinned,
        it is copied to a pinned-host array first and from there to the device."""
        if self.pinned:
            try:
                return jax.device_put(jax.device_put(view, sharding.with_memory_kind("pinned_host")), sharding)
            except Exception as e:
                self._give_up(e)
        return jax.device_put(view, sharding)
