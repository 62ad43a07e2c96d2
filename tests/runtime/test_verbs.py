"""The table of RPC verbs (runtime/wire/verbs.py): what the worker's service serves and what
the control plane sends are the table's records, and a header that does not match its verb's
record is refused by the table, naming the verb and the field. Over real gRPC to a real
worker: tests/runtime/test_control_faults.py."""

import dataclasses
import typing

import numpy as np
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
    for verb in [*verbs.VERBS.values(), *verbs.MANAGER_VERBS.values()]:
        for record in (verb.request, verb.reply):
            assert dataclasses.is_dataclass(record)
            verbs._fields(record)  # asserts each field is one of the JSON types the table checks


def test_a_request_round_trips_through_its_header():
    sent = verbs.Run("train", 12, after=11, feeds={"x": [{"$blob": 0}]}, fetch=["loss/0"], trace=True)
    header = verbs.encode(sent)
    assert header == {
        "plan": "train",
        "run": 12,
        "after": 11,
        "feeds": {"x": [{"$blob": 0}]},
        "fetch": ["loss/0"],
        "trace": True,
    }
    assert verbs.decode_request(verbs.verb_of(sent), header) == sent
    # Optional fields left None are not sent, and come back as None.
    put = verbs.Put("w", [{"$blob": 0}])
    assert verbs.encode(put) == {"name": "w", "arrays": [{"$blob": 0}]}
    assert verbs.decode_request("Put", verbs.encode(put)) == put
    # A float field takes an int (JSON does not tell 2 from 2.0); a bool is never an int.
    assert verbs.decode_request("OpenSession", {"job": "j", "root": "/r", "lease_s": 2}).lease_s == 2


@pytest.mark.parametrize(
    "verb,header,says",
    [
        ("Run", {"plan": "p"}, "Run request field 'run' must be an integer; it is missing"),
        ("Run", {"plan": "p", "run": 1.5}, "Run request field 'run' must be an integer, got float"),
        ("Run", {"plan": "p", "run": False}, "Run request field 'run' must be an integer, got bool"),
        ("Run", {"plan": "p", "run": 1, "fetch": "loss"}, "Run request field 'fetch' must be a list, got str"),
        ("Run", {"plan": "p", "run": 1, "stepp": 1}, "Run request has no field 'stepp'; its fields are plan, run,"),
        ("WaitSaves", {"directories": "d"}, "WaitSaves request field 'directories' must be a list or null"),
        ("Heartbeat", {"now": 1}, "Heartbeat request has no field 'now'; its fields are none"),
        ("Teleport", {}, "no verb 'Teleport'; the verbs are Hello, Setup,"),
    ],
)
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


@pytest.mark.parametrize(
    "request_of",
    [
        lambda c: c.put(0, 7, [np.zeros(2, np.float32)]),
        lambda c: c.install_plan(0, ("train",), []),
        lambda c: c.save(0, ["params"]),
        lambda c: c.restore(0, {}, staged="no"),
        lambda c: c.finish_restore(0, commit="yes"),
    ],
    ids=["Put", "InstallPlan", "Save", "Restore", "FinishRestore"],
)
def test_the_in_process_cluster_checks_every_verb_against_the_table(request_of):
    import mpmd

    cluster = mpmd.InProcessCluster()
    cluster.start(1)
    try:
        with pytest.raises(ValueError, match=r"^\w+ record field '\w+' must be"):
            request_of(cluster)
        assert cluster.executors[0].buffers == {}  # refused before the slice saw it
    finally:
        cluster.close()


# -- the shared cluster's manager: a second table in the same style ---------------------------
def test_the_manager_serves_exactly_its_table():
    from mpmd.runtime.manager import core

    assert core.METHODS == {n: v.caller for n, v in verbs.MANAGER_VERBS.items()}
    assert core.SERVICE == verbs.MANAGER_SERVICE and verbs.TABLES[core.SERVICE] is verbs.MANAGER_VERBS
    assert set(core.METHODS) == {"Submit", "Status", "Wait", "Renew", "Release", "Replace", "Down"}


@pytest.mark.parametrize(
    "verb,header,says",
    [
        ("Submit", {"root": "/r"}, "Submit request field 'slices' must be an integer; it is missing"),
        ("Submit", {"slices": "2", "root": "/r"}, "Submit request field 'slices' must be an integer, got str"),
        ("Submit", {"slices": 1, "root": "/r", "priority": 9}, "Submit request has no field 'priority'"),
        ("Wait", {}, "Wait request field 'job' must be a string; it is missing"),
        ("Replace", {"job": "j-1", "slot": None}, "Replace request field 'slot' must be an integer, got NoneType"),
    ],
)
def test_the_manager_table_refuses_a_header_that_does_not_match_the_verb(verb, header, says):
    with pytest.raises(ValueError) as e:
        verbs.decode_request(verb, header, verbs.MANAGER_VERBS)
    assert str(e.value).startswith(says), str(e.value)
    assert verbs.decode_request("Submit", {"slices": 1, "root": "/r"}, verbs.MANAGER_VERBS) == verbs.Submit(1, "/r")


def test_the_manager_answers_a_request_missing_a_field_invalid_argument_naming_it(tmp_path):
    """Its gRPC handler, called as gRPC calls it (no server, no workers): the body is checked
    against the table before the manager acts on it."""
    import types

    import grpc

    from mpmd.runtime.manager import core, server
    from mpmd.runtime.wire import format as wire
    from mpmd.runtime.worker.service import TOKEN_KEY

    pool = types.SimpleNamespace(workers=[], root=str(tmp_path), devices_per_worker=1)
    manager = core.Manager(pool, cluster_token="c" * 32, submit_token="s" * 32, journal=str(tmp_path / "jobs.json"))

    class Aborted(Exception):
        pass

    class Context:
        def abort(self, code, details):
            self.code, self.details = code, details
            raise Aborted

        def peer(self):
            return "test"

    details = types.SimpleNamespace(method=f"/{core.SERVICE}/Submit", invocation_metadata=((TOKEN_KEY, "s" * 32),))
    handler = server.Handler(manager).service(details)
    context = Context()
    with pytest.raises(Aborted):
        handler.unary_unary(wire.encode({"name": "x", "root": str(tmp_path)}, []), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == "Submit: Submit request field 'slices' must be an integer; it is missing"
    assert manager.jobs == {}  # nothing was queued
