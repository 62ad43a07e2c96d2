"""runtime/worker/failpoints.py: MPMD_FAILPOINTS is parsed strictly, and a point pauses at the
hit it is armed at only, saying so in the log. The failpoints in use: tests/runtime/test_hosts.py."""

import logging

import pytest

from mpmd.runtime.worker import failpoints


def test_a_spec_arms_each_point_at_its_hits():
    assert failpoints.parse("") == {}
    assert failpoints.parse("save@2=pause:12, transfer@40=pause:0.5,save@5=busy:1") == {
        "save": {2: ("pause", 12.0), 5: ("busy", 1.0)},
        "transfer": {40: ("pause", 0.5)},
    }


@pytest.mark.parametrize(
    "bad", ["save", "save@2", "save@2=sleep:1", "save@0=pause:1", "nowhere@1=pause:1", "save@x=pause:1"]
)
def test_a_bad_entry_is_named_with_the_form_allowed(bad):
    with pytest.raises(ValueError, match=rf"MPMD_FAILPOINTS entry '{bad}' must be 'point@hit=pause:seconds'"):
        failpoints.parse(f"transfer@1=pause:1,{bad}")


def test_a_point_pauses_at_its_armed_hit_only(monkeypatch, caplog):
    slept = []
    monkeypatch.setattr(failpoints, "armed", failpoints.parse("restore@2=pause:7"))
    monkeypatch.setattr(failpoints, "_hits", {})
    monkeypatch.setattr(failpoints.time, "sleep", slept.append)
    with caplog.at_level(logging.WARNING, logger="mpmd.failpoints"):
        for i in range(4):
            failpoints.hit("restore", f"reading part {i}")
            failpoints.hit("save", "not armed")
    assert slept == [7.0]
    assert [r.getMessage() for r in caplog.records] == [
        "failpoint restore reached (hit 2: reading part 1); pausing 7 s",
        "failpoint restore: going on",
    ]
    assert failpoints._hits == {"restore": 4}  # a point not armed is not even counted
