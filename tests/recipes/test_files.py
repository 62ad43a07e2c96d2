"""recipes/files.py publish(): a file is replaced whole or not at all. SIGKILLed between
writing the new bytes and the rename, the old file is intact and the partial one is the
only trace; an error while writing removes the partial. `mpmd sft-data` writes through it."""

import json

import pytest

from mpmd.recipes.commands import sft_data as sft_data_cli
from mpmd.recipes.files import PARTIAL, publish
from tests.support.processes import sigkill_at_marker

KILLED_BEFORE_RENAME = """
import os, sys, time
from pathlib import Path
from mpmd.recipes import files

def replace_later(src, dst):
    Path(sys.argv[2]).write_text("written")
    time.sleep(60)  # killed here: the new bytes on disk, not yet renamed
files.os.replace = replace_later
files.publish(sys.argv[1], "new contents\\n" * 1000)
"""


def test_a_publish_killed_before_its_rename_leaves_the_old_file(tmp_path):
    target, marker = tmp_path / "config.yaml", tmp_path / "marker"
    target.write_text("old contents\n")
    sigkill_at_marker(KILLED_BEFORE_RENAME, [target, marker], marker)
    assert target.read_text() == "old contents\n"
    assert (tmp_path / ("config.yaml" + PARTIAL)).exists()
    publish(target, "next\n")  # the next write goes through
    assert target.read_text() == "next\n" and not (tmp_path / ("config.yaml" + PARTIAL)).exists()


def test_a_failed_write_leaves_no_partial(tmp_path, monkeypatch):
    target = tmp_path / "a.json"
    target.write_text("{}")

    class Full(OSError):
        pass

    def fail(*_):
        raise Full(28, "No space left on device")

    monkeypatch.setattr("mpmd.recipes.files.os.fsync", fail)
    with pytest.raises(Full):
        publish(target, "x" * 100)
    assert target.read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_sft_data_over_an_existing_set_replaces_both_files_or_neither(tmp_path, capsys):
    out = tmp_path / "sft"
    assert sft_data_cli.main(["-o", str(out), "--train", "20", "--heldout", "5"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit):  # refused as parsed: nothing written
        sft_data_cli.main(["-o", str(out), "--train", "-3"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sft_data_cli.main(["-o", str(out), "--train", "7", "--heldout", "2", "--seed", "1"]) == 0
    lines = (out / "train.jsonl").read_text().splitlines()
    assert len(lines) == 7 and all(json.loads(line)["prompt"] for line in lines)
    assert sorted(p.name for p in out.iterdir()) == ["heldout.jsonl", "train.jsonl"]
