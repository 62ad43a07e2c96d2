"""Host staging of the same-host data plane (runtime/wire/staging.py): which way auto
picks, the errors for a bad choice, and what happens when a copy through pinned host memory
fails. Transfers staged through pinned memory between real workers are in test_transport.py
(the shm+pinned pair) and test_shm.py."""

import jax
import numpy as np
import pytest

from mpmd.runtime.wire.staging import Staging


def test_host_staging_is_checked_and_auto_stages_through_pinned_memory_off_cpu_only():
    cpus = jax.devices("cpu")
    assert [Staging.of(cpus, s).pinned for s in ("auto", "pinned", "pageable")] == [False, True, False]

    class Memory:
        def __init__(self, kind):
            self.kind = kind

    class Device:  # what Staging.of reads of a device: platform, memories
        def __init__(self, platform, kinds):
            self.platform, self._kinds = platform, kinds

        def addressable_memories(self):
            return [Memory(k) for k in self._kinds]

        def __str__(self):
            return f"{self.platform}:0"

    gpu = Device("gpu", ("device", "pinned_host", "unpinned_host"))
    bare = Device("gpu", ("device",))
    assert Staging.of([gpu]).pinned and not Staging.of([bare]).pinned
    with pytest.raises(
        ValueError,
        match="host staging 'pinned': device gpu:0 has no pinned host memory "
        r"\(its memories: device\); use auto or pageable",
    ):
        Staging.of([bare], "pinned")
    with pytest.raises(ValueError, match="host staging must be one of auto, pinned, pageable, got 'locked'"):
        Staging.of(cpus, "locked")


def test_a_failing_pinned_copy_falls_back_to_pageable_under_auto_and_fails_when_forced(monkeypatch, caplog):
    device = jax.devices("cpu")[0]
    sharding = jax.sharding.make_single_device_sharding(device)
    x = jax.device_put(np.arange(6, dtype=np.float32), device)
    real_put = jax.device_put

    def no_pinned(value, to=None, **kw):  # a platform whose pinned host memory takes no copy
        if getattr(to, "memory_kind", None) == "pinned_host":
            raise RuntimeError("UNIMPLEMENTED: pinned_host")
        return real_put(value, to, **kw)

    monkeypatch.setattr(jax, "device_put", no_pinned)
    auto = Staging(True)  # what auto picks on an accelerator
    assert np.array_equal(auto.to_host(x), np.arange(6)) and not auto.pinned
    assert "stage through pageable host memory from now on" in caplog.text
    landed = Staging(True).to_device(np.arange(6, dtype=np.float32), sharding)
    assert np.array_equal(np.asarray(landed), np.arange(6)) and landed.devices() == {device}
    with pytest.raises(RuntimeError, match="UNIMPLEMENTED: pinned_host"):
        Staging(True, forced=True).to_host(x)
