"""Snapshots never delete what is not theirs, live in a per-job directory, and a torn or corrupt
newest snapshot falls back to the one before it."""

import doctest
import json
import os

import numpy as np
import pytest

from islands.syncer import state
from islands.syncer.state import (SnapshotDirError, SnapshotError, SnapshotStore,
                                  snapshot_directory, snapshot_steps)
from islands.syncer.validate import Push

from test_snapshot import build  # tests/unit is on sys.path under pytest (rootdir conftest)


def merged(core, rounds=1, start=0):
    core.register("a", 0)
    for r in range(start, start + rounds):
        core.accept_push(Push("a", 0, {"w": np.full(3, -0.5, np.float32)}, core.versions[0],
                              core.epoch, 64, 2, step=2 * r + 2, tokens_done=128 * (r + 1)), 0.0)
        core.merge(0)
    return core


def test_fresh_store_refuses_a_directory_with_snapshots_and_deletes_nothing(tmp_path):
    directory = tmp_path / "ckpt"
    store = SnapshotStore(str(directory))
    store.save(merged(build()))
    store.close()
    (directory / "notes.txt").write_text("mine")
    before = sorted(os.listdir(directory))

    with pytest.raises(SnapshotDirError) as info:
        SnapshotStore(str(directory), fresh=True)
    assert str(directory) in str(info.value) and "--resume" in str(info.value)
    assert sorted(os.listdir(directory)) == before       # the old snapshot and the user's file
    assert (directory / "notes.txt").read_text() == "mine"
    # Restoring (a syncer restart, or a resumed job) still finds the old snapshot.
    store = SnapshotStore(str(directory))
    assert store.restore_latest(build()) == 1
    store.close()


def test_fresh_store_in_a_directory_of_user_files_keeps_them(tmp_path):
    (tmp_path / "keep.py").write_text("x = 1\n")
    store = SnapshotStore(str(tmp_path), fresh=True)
    store.save(merged(build()))
    store.close()
    assert (tmp_path / "keep.py").read_text() == "x = 1\n"
    assert snapshot_steps(str(tmp_path)) == ["1"]


def test_snapshot_directory_is_per_job_inside_a_user_named_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # `checkpoint_dir: .` used to be emptied at job start; now the job writes only into ./<name>.
    assert snapshot_directory(".", "runs/x", "x") == str(tmp_path / "x")
    assert snapshot_directory(None, "runs/x", "x") == str(tmp_path / "runs" / "x" / "syncer")
    assert snapshot_directory("/ckpt", "r", "../../etc") == "/ckpt/.._.._etc"
    assert snapshot_directory("/ckpt", "r", "..") == "/ckpt/job__"
    assert os.path.isabs(snapshot_directory("rel", "r", "j"))
    result = doctest.testmod(state)
    assert result.attempted > 0 and result.failed == 0


def _two_snapshots(directory):
    core = build()
    store = SnapshotStore(str(directory))
    merged(core, 1)
    assert store.save(core) == 1
    w_at_1 = core.slots[0].params["w"].copy()
    merged(core, 1, start=1)
    assert store.save(core) == 2
    store.close()
    return w_at_1


# orbax's async reader may complain once its loop is closed after the failed read; harmless.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_truncated_newest_snapshot_falls_back_to_the_previous(tmp_path, caplog):
    w_at_1 = _two_snapshots(tmp_path)
    arrays_dir = tmp_path / "2" / "arrays"
    data_files = [os.path.join(d, f) for d, _, fs in os.walk(arrays_dir) for f in fs
                  if os.path.basename(d) == "d"]
    assert data_files
    for path in data_files:  # a crash mid-write (or a full disk) tore the array data
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    fresh = build()
    store = SnapshotStore(str(tmp_path))
    with caplog.at_level("WARNING", logger="islands.syncer.state"):
        assert store.restore_latest(fresh) == 1
    store.close()
    assert "step 2" in caplog.text
    np.testing.assert_array_equal(fresh.slots[0].params["w"], w_at_1)
    assert fresh.versions == (1, 0)


def test_a_checksum_mismatch_falls_back_and_none_intact_is_an_error(tmp_path, caplog):
    w_at_1 = _two_snapshots(tmp_path)
    meta_path = tmp_path / "2" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    assert len(meta["sha256"]) == 64
    meta["sha256"] = "0" * 64  # arrays that read back fine but are not what was written
    meta_path.write_text(json.dumps(meta))

    fresh = build()
    store = SnapshotStore(str(tmp_path))
    with caplog.at_level("WARNING", logger="islands.syncer.state"):
        assert store.restore_latest(fresh) == 1
    np.testing.assert_array_equal(fresh.slots[0].params["w"], w_at_1)
    assert "sha256" in caplog.text

    meta_path = tmp_path / "1" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["sha256"] = "1" * 64
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(SnapshotError, match="no intact snapshot"):
        store.restore_latest(build())
    store.close()


def test_checksum_is_stable_and_sensitive():
    arrays, meta = state.snapshot_tree(merged(build()))
    same, _ = state.snapshot_tree(merged(build()))
    assert state.arrays_checksum(arrays) == state.arrays_checksum(same)
    arrays["params"]["0"]["w"] = arrays["params"]["0"]["w"] + 1
    assert state.arrays_checksum(arrays) != state.arrays_checksum(same)
