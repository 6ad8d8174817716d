"""Checkpointer: complete checkpoints only, the newest N kept, loaded by update count."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from learner.training import checkpoint


def tree(value: float) -> dict:
    return {
        "dense": {"kernel": np.full((3, 2), value, np.float32), "bias": np.zeros(2, np.float32)}
    }


def test_keeps_the_newest_and_loads_any_kept_one(tmp_path):
    saver = checkpoint.Checkpointer(str(tmp_path), interval_s=3600, keep=2)
    assert not saver.due()
    for updates in (10, 20, 30):
        assert saver.save(updates, tree(updates), {"mu": tree(-updates)}, {"env_steps": updates})
    assert not saver.save(30, tree(0), {}, {})  # the same update twice: nothing new
    saver.close()
    assert checkpoint.available(str(tmp_path)) == [20, 30]
    params, meta = checkpoint.load_params(str(tmp_path), tree(0))
    assert meta["updates"] == 30 and meta["env_steps"] == 30
    np.testing.assert_array_equal(params["dense"]["kernel"], tree(30)["dense"]["kernel"])
    params, _ = checkpoint.load_params(str(tmp_path), tree(0), updates=20)
    assert params["dense"]["kernel"][0, 0] == 20
    with pytest.raises(checkpoint.NoCheckpointError, match="there are: 20, 30"):
        checkpoint.load_params(str(tmp_path), tree(0), updates=10)


def test_a_checkpoint_is_due_after_its_interval(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("learner.training.checkpoint.time.monotonic", lambda: clock[0])
    saver = checkpoint.Checkpointer(str(tmp_path), interval_s=60, keep=1)
    assert not saver.due()
    clock[0] += 61
    assert saver.due()
    saver.save(1, tree(1), {}, {})
    assert not saver.due()
    saver.close()


# orbax, its restore failing on a jax array's shape, leaves a callback for its closed
# event loop behind; the error raised is the test's subject.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_of_another_network_is_a_clear_error(tmp_path):
    saver = checkpoint.Checkpointer(str(tmp_path), interval_s=3600, keep=1)
    saver.save(7, tree(1), {}, {})
    saver.close()
    wider = {"dense": {"kernel": np.zeros((3, 4), np.float32), "bias": np.zeros(4, np.float32)}}
    with pytest.raises(
        checkpoint.CheckpointMismatch, match=r"update 7 .* does not fit.*config\.json"
    ):
        checkpoint.load_params(str(tmp_path), wider)
    on_device = jax.tree.map(jax.numpy.asarray, wider)  # as the learner builds them
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"update 7 .* does not fit"):
        checkpoint.load_params(str(tmp_path), on_device)
    other_layers = {"conv": {"kernel": np.zeros((3, 2), np.float32)}}
    with pytest.raises(checkpoint.CheckpointMismatch, match="does not fit"):
        checkpoint.load_params(str(tmp_path), other_layers)
    params, _ = checkpoint.load_params(str(tmp_path), tree(0))  # its own network still loads
    assert params["dense"]["kernel"][0, 0] == 1


def test_an_empty_run_has_none(tmp_path):
    assert checkpoint.available(str(tmp_path)) == []
    with pytest.raises(checkpoint.NoCheckpointError, match="no complete checkpoint"):
        checkpoint.load_params(str(tmp_path), tree(0))


def test_an_unfinished_checkpoint_is_not_listed(tmp_path):
    saver = checkpoint.Checkpointer(str(tmp_path), interval_s=3600, keep=3)
    saver.save(5, tree(5), {}, {})
    saver.close()
    # What a crash mid-save leaves: orbax's temporary directory, never renamed.
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-123").mkdir()
    assert checkpoint.available(str(tmp_path)) == [5]


def test_a_half_deleted_checkpoint_is_not_listed(tmp_path):
    saver = checkpoint.Checkpointer(str(tmp_path), interval_s=3600, keep=5)
    for updates in (1, 2):
        saver.save(updates, tree(updates), {"mu": tree(0)}, {})
    saver.close()
    # What a recursive delete killed halfway leaves: the directory, some of its items.
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "1" / "params")
    (tmp_path / "checkpoints" / "1" / "_CHECKPOINT_METADATA").unlink()
    assert checkpoint.available(str(tmp_path)) == [2]


def test_old_checkpoints_go_by_rename_and_the_trash_is_emptied(tmp_path):
    saver = checkpoint.Checkpointer(str(tmp_path), interval_s=3600, keep=1)
    for updates in (1, 2, 3):
        saver.save(updates, tree(updates), {"mu": tree(0)}, {})
    saver.close()
    saver = checkpoint.Checkpointer(str(tmp_path), interval_s=3600, keep=1)
    saver.close()
    names = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert names == ["3"]
