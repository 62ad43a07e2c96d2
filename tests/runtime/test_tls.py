"""Mutual TLS on the control plane (runtime/wire/tls.py).

- A cluster's certificates: made once, never overwritten, refused when unreadable or when
  the key is readable by others; `mpmd cluster certs DIR` makes them.
- A worker serving TLS answers a client holding a certificate of its authority, and nobody
  else: not a client in the clear, not one of another authority; and a controller refuses a
  worker of another authority (it cannot pose as one of ours).
- Across hosts (tests/support/netns.py), with the wire read on the controller's host: in the
  clear the token and Setup's transfer secret are there for anyone to read; with TLS neither
  is, nor any run of hex digits a secret could be, and the run's losses are the same.
"""

import collections
import dataclasses
import json
import os
import re
import signal
import stat
import subprocess
import sys

import pytest

from mpmd.recipes.commands import cluster as cluster_command
from mpmd.recipes.run import run_log
from mpmd.runtime.control.rpc import WorkerClient, WorkerError
from mpmd.runtime.wire import tls
from tests.support import netns, wire_capture
from tests.support.processes import ROOT, Controller, StandaloneWorkers, tiny_gpt_run

pytestmark = pytest.mark.platform  # certificates, handshakes and the wire (tests/README.md)


def test_certificates_are_made_once_and_refused_when_unsafe(tmp_path):
    made = tls.make(tmp_path / "a")
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "key.pem").st_mode) == 0o600
    assert tls.load(tmp_path / "a") == made
    before = (tmp_path / "a" / "key.pem").read_bytes()
    with pytest.raises(ValueError, match="already holds ca.pem, cert.pem, key.pem"):
        tls.make(tmp_path / "a")
    assert (tmp_path / "a" / "key.pem").read_bytes() == before  # nothing replaced
    os.chmod(tmp_path / "a" / "key.pem", 0o644)
    with pytest.raises(ValueError, match=r"cluster.tls: .*key.pem may be read by others .* chmod 600"):
        tls.load(tmp_path / "a")
    with pytest.raises(ValueError, match=r"--tls: cannot read .*ca.pem.*ca.pem, cert.pem, key.pem"):
        tls.load(tmp_path / "missing", "--tls")
    (tmp_path / "b").mkdir()
    for name in tls.FILES:
        (tmp_path / "b" / name).write_text("not a certificate")
        os.chmod(tmp_path / "b" / name, 0o600)
    with pytest.raises(ValueError, match="ca.pem is not a PEM file"):
        tls.load(tmp_path / "b")
    with pytest.raises(ValueError, match="tls must be True .*, False .* or a directory, got 3"):
        tls.cluster_tls(3)
    assert tls.from_line(tls.to_line(made)) == dataclasses.replace(made, directory="")


def test_cluster_certs_command_makes_a_directory_and_never_replaces_one(tmp_path, capsys):
    assert cluster_command.main(["certs", str(tmp_path / "c")]) == 0
    assert "wrote " in capsys.readouterr().out
    tls.load(tmp_path / "c")
    assert cluster_command.main(["certs", str(tmp_path / "c")]) == 2
    assert "already holds" in capsys.readouterr().err


def test_a_worker_with_an_unreadable_tls_directory_says_so_in_one_line(tmp_path):
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123\n")
    token.chmod(0o600)
    r = subprocess.run(
        [sys.executable, "-m", "mpmd.recipes.cli", "worker", "--token-file", str(token), "--tls", str(tmp_path / "no")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("error: --tls: cannot read"), r.stderr


@pytest.mark.slow
def test_only_peers_of_the_clusters_authority_get_through(tmp_path):
    ours, theirs = tls.make(tmp_path / "ours"), tls.make(tmp_path / "theirs")
    (tmp_path / "w0").mkdir()
    (tmp_path / "w1").mkdir()
    with (
        StandaloneWorkers(tmp_path / "w0", 1, shared=False, tls=ours.directory) as mine,
        StandaloneWorkers(tmp_path / "w1", 1, shared=False, tls=theirs.directory) as impostor,
    ):
        counts = collections.Counter()
        good = WorkerClient(mine.addresses[0], mine.token, counts, tls=ours)
        try:
            good.wait_ready(10)
            assert good.call("Hello")[0]["pid"] == mine.procs[0].pid
        finally:
            good.close()
        for who, client, says in (
            ("a client in the clear", WorkerClient(mine.addresses[0], mine.token, counts), "speaks in the clear"),
            (
                "a client of another authority",
                WorkerClient(mine.addresses[0], mine.token, counts, tls=theirs),
                "same authority",
            ),
            (
                "a worker of another authority",
                WorkerClient(impostor.addresses[0], impostor.token, counts, tls=ours),
                "same authority",
            ),
        ):
            try:
                with pytest.raises(WorkerError, match=says):
                    client.wait_ready(2)
                with pytest.raises(WorkerError, match="UNAVAILABLE"):
                    client.call("Hello", timeout_s=2)
            finally:
                client.close()
        assert "mutual TLS" in mine.logs[0].read_text()
        # The refused handshakes reached no handler: nothing was refused for its token.
        assert "refused" not in mine.logs[0].read_text()


STEPS = 4
# A client on another host holding the token: in the clear, and with another authority's
# certificates. Prints what happened to each.
INTRUDER = """
import collections, json, sys
from mpmd.runtime.control.rpc import WorkerClient, WorkerError
from mpmd.runtime.wire.tls import load
address, token_file, other = sys.argv[1:]
token = open(token_file).read().strip()
out = {}
for name, certs in (("clear", None), ("other authority", load(other))):
    c = WorkerClient(address, token, collections.Counter(), tls=certs)
    try:
        c.call("Hello", timeout_s=3)
        out[name] = "answered"
    except WorkerError as e:
        out[name] = "refused" if "UNAVAILABLE" in str(e) else str(e)
    c.close()
print(json.dumps(out))
"""
HEX_RUN = re.compile(rb"[0-9a-f]{32}")


def _run_across_hosts(tmp_path, certs: str | None):
    """Host 0: the controller, the wire read there; hosts 1 and 2: a worker each, serving TLS
    with `certs` (None: in the clear). (every TCP stream host 0 saw, token, losses)."""
    with netns.Hosts(3) as hosts:
        capture = tmp_path / "wire"
        sniffer = hosts.popen(
            0,
            [sys.executable, "-m", "tests.support.wire_capture", "eth0", str(capture)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sniffer.stdout.readline().strip() == "capturing"
        with StandaloneWorkers(tmp_path, 2, shared=False, hosts=hosts, on=[1, 2], tls=certs) as workers:
            if certs:  # from the controller's host, strangers holding the token get nowhere
                other = tls.make(tmp_path / "other").directory
                refused = hosts.popen(
                    0,
                    [sys.executable, "-c", INTRUDER, workers.addresses[1], str(tmp_path / "token"), other],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                out, _ = refused.communicate(timeout=60)
                assert json.loads(out) == {"clear": "refused", "other authority": "refused"}, out
            addresses = ",".join(f'"{a}"' for a in workers.addresses)
            args = [
                "configs/gpt_tiny.yaml",
                *tiny_gpt_run(STEPS, 2),
                "cluster.backend=static",
                f"cluster.addresses=[{addresses}]",
                f"cluster.token_file={tmp_path / 'token'}",
                f"cluster.tls={certs or 'off'}",
            ]
            run_dir = workers.root / "run"
            Controller(run_dir, args, prefix=["ip", "netns", "exec", hosts.names[0]]).succeed()
        sniffer.send_signal(signal.SIGTERM)
        sniffer.wait(timeout=10)
        losses = {r["step"]: r["loss"] for r in run_log.read(run_dir)}
        return wire_capture.streams(capture), workers.token, losses


@pytest.mark.slow
def test_across_hosts_the_token_and_the_session_secret_never_cross_the_wire_in_the_clear(tmp_path):
    netns.skip_unless_root()
    (tmp_path / "clear").mkdir()
    (tmp_path / "tls").mkdir()
    clear, token, clear_losses = _run_across_hosts(tmp_path / "clear", None)
    wire = b"".join(clear.values())
    # In the clear, both are there for anyone on the path: the token in the calls' metadata,
    # the transfer secret in Setup's JSON header.
    secrets_seen = re.findall(rb'"transfer_secret": ?"([0-9a-f]{64})"', wire)
    assert secrets_seen, "the reader saw no Setup: it reads nothing"
    assert token.encode() in wire

    certs = tls.make(tmp_path / "certs").directory
    streams, token, losses = _run_across_hosts(tmp_path / "tls", certs)
    wire = b"".join(streams.values())
    assert len(wire) > 10_000, len(wire)  # the run's calls crossed this interface
    assert token.encode() not in wire
    assert b"transfer_secret" not in wire and b"mpmd-token" not in wire
    assert not HEX_RUN.search(wire), HEX_RUN.search(wire)
    assert sorted(losses) == sorted(clear_losses) and all(losses[s] == clear_losses[s] for s in losses)
    assert len(losses) == STEPS
