"""This replica's spill root is its own (issue 29 item 11): created 0700 at start, emptied of
what an earlier run of ours left, refused (a start-up error) when it is a link, not a
directory, or another user's; and a partition directory that is not ours is never used."""

from __future__ import annotations

import os
import stat

import pytest

from stage.buffer.spill import SpillDirError, SpillStore, prepare_spill_root


def test_the_root_is_created_private_and_a_previous_runs_left_overs_go(tmp_path):
    root = tmp_path / "spill" / "rollout-reassembler-spill-x"
    assert prepare_spill_root(root) == root
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    (root / "partition-0-epoch-1").mkdir()
    (root / "partition-0-epoch-1" / "segment-000001").write_bytes(b"old")
    os.chmod(root, 0o777)
    prepare_spill_root(root)
    assert list(root.iterdir()) == [] and stat.S_IMODE(os.lstat(root).st_mode) == 0o700


def test_a_root_that_is_a_link_or_a_file_is_refused_and_left_alone(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("someone's file")
    os.symlink(elsewhere, tmp_path / "root")
    with pytest.raises(SpillDirError, match="is a symbolic link: refusing to spill there"):
        prepare_spill_root(tmp_path / "root")
    assert (elsewhere / "keep").read_text() == "someone's file"
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(SpillDirError, match="is not a directory"):
        prepare_spill_root(tmp_path / "file")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_root_another_user_owns_is_refused_and_left_alone(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o777)
    (root / "theirs").write_text("another user's file")
    os.chown(root, 4242, 4242)
    with pytest.raises(SpillDirError, match="belongs to uid 4242"):
        prepare_spill_root(root)
    assert (root / "theirs").read_text() == "another user's file"
    store = SpillStore(root / "p0", max_bytes=1 << 20)     # nor used when spilling starts
    (root / "p0").mkdir()
    os.chown(root / "p0", 4242, 4242)
    assert store.put(b"x") is None and "belongs to uid 4242" in store.failed


def test_the_stage_refuses_to_start_on_a_spill_root_that_is_not_its_own(tmp_path):
    """At start (stage.runtime.loop): a configuration error, before any client connects; the
    linked directory is left as it was (it used to be emptied, silently, or written into)."""
    from stage.config.model import StageConfig
    from stage.runtime import exits
    from stage.runtime.loop import StageRuntime

    runtime = StageRuntime(StageConfig(bootstrap_servers="127.0.0.1:9", spill_dir=str(tmp_path),
                                       metrics_port=0))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("someone's file")
    os.symlink(elsewhere, runtime.spill_root)
    with pytest.raises(exits.StageExit) as stopped:
        runtime.start()
    assert stopped.value.code == exits.EXIT_CONFIG, str(stopped.value)
    assert "is a symbolic link: refusing to spill there" in str(stopped.value)
    assert (elsewhere / "keep").read_text() == "someone's file"
