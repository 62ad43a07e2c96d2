"""The table of RPC verbs (runtime/wire/verbs.py): what the worker's service serves and what
the control plane sends are the table's records, and a header that does not match its verb's
record is refused by the table, naming the verb and the field. Over real gRPC to a real
worker: tests/runtime/test_control_faults.py."""
import dataclasses
import typing

import pytest

from mpmd.runtime.wire import verbs
from mpmd.runtime.worker import service


def test_the_service_serves_exactly_the_verbs_of_the_table_each_with_its_request_record():
    assert service.METHODS == tuple(verbs.VERBS)
    for name, verb in verbs.VERBS.items():
        handler = getattr(service.WorkerService, name)
        hints = typing.get_type_hints(handler, globalns=vars(service))
        assert hints.get("r") is verb.request, f"{name}'s handler takes {hints.get('r')}, the table says {verb.request}"
    admin = {n for n, v in verbs.VERBS.items() if v.caller == "admin"}
    assert set(service.ADMIN_METHODS) == admin == {"OpenSession", "CloseSession", "Sessions"}


def test_every_record_field_has_a_wire_type():
    for verb in verbs.VERBS.values():
        for record in (verb.request, verb.reply):
            assert dataclasses.is_dataclass(record)
            verbs._fields(record)     # asserts each field is one of the JSON types the table checks


def test_a_request_round_trips_through_its_header():
    sent = verbs.Run("train", 12, after=11, feeds={"x": [{"$blob": 0}]}, fetch=["loss/0"], trace=True)
    header = verbs.encode(sent)
    assert header == {"plan": "train", "run": 12, "after": 11, "feeds": {"x": [{"$blob": 0}]},
                      "fetch": ["loss/0"], "trace": True}
    assert verbs.decode_request(verbs.verb_of(sent), header) == sent
    # Optional fields left None are not sent, and come back as None.
    put = verbs.Put("w", [{"$blob": 0}])
    assert verbs.encode(put) == {"name": "w", "arrays": [{"$blob": 0}]}
    assert verbs.decode_request("Put", verbs.encode(put)) == put
    # A float field takes an int (JSON does not tell 2 from 2.0); a bool is never an int.
    assert verbs.decode_request("OpenSession", {"job": "j", "root": "/r", "lease_s": 2}).lease_s == 2


@pytest.mark.parametrize("verb,header,says", [
    ("Run", {"plan": "p"}, "Run request field 'run' must be an integer; it is missing"),
    ("Run", {"plan": "p", "run": 1.5}, "Run request field 'run' must be an integer, got float"),
    ("Run", {"plan": "p", "run": False}, "Run request field 'run' must be an integer, got bool"),
    ("Run", {"plan": "p", "run": 1, "fetch": "loss"}, "Run request field 'fetch' must be a list, got str"),
    ("Run", {"plan": "p", "run": 1, "stepp": 1}, "Run request has no field 'stepp'; its fields are plan, run,"),
    ("WaitSaves", {"directories": "d"}, "WaitSaves request field 'directories' must be a list or null"),
    ("Heartbeat", {"now": 1}, "Heartbeat request has no field 'now'; its fields are none"),
    ("Teleport", {}, "no verb 'Teleport'; the verbs are Hello, Setup,"),
])
def test_the_table_refuses_a_header_that_does_not_match_the_verb(verb, header, says):
    with pytest.raises(ValueError) as e:
        verbs.decode_request(verb, header)
    assert str(e.value).startswith(says), str(e.value)


def test_a_reply_is_checked_too():
    with pytest.raises(ValueError, match="Setup reply field 'transfer_address' must be a string; it is missing"):
        verbs.decode_reply("Setup", {})
    assert verbs.decode_reply("Heartbeat", {"pid": 1, "running": False}).progress is None



def test_a_record_is_checked_before_it_is_sent_and_in_process_too():
    import mpmd
    with pytest.raises(ValueError, match="Run record field 'run' must be an integer, got str"):
        verbs.encode(verbs.Run("train", "12"))
    cluster = mpmd.InProcessCluster()
    cluster.start(1)
    try:
        with pytest.raises(ValueError, match="Run record field 'trace' must be a bool, got str"):
            cluster.launch("train", 1, {}, {}, trace="yes")
        with pytest.raises(ValueError, match="Run record field 'run' must be an integer, got float"):
            cluster.run("train", 1.0, {}, {})
    finally:
        cluster.close()
