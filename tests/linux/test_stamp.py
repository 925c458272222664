"""Telling a changed file from the one last looked at, without reading it."""

from __future__ import annotations

import os
from pathlib import Path

from gpuwait.linux.stamp import file_stamp


def test_a_file_rewritten_in_place_with_its_old_size_and_time_is_told_changed(
    tmp_path: Path,
) -> None:
    # An editor's save of a one-character change, its time then set back (`touch -d`).
    path = tmp_path / "config.toml"
    path.write_text("safety = 0.8\n")
    before = file_stamp(path)
    assert before is not None
    path.write_text("safety = 0.7\n")
    os.utime(path, ns=(before.mtime_ns, before.mtime_ns))
    assert file_stamp(path) != before


def test_a_file_replaced_by_rename_is_told_changed_and_a_link_only_when_followed(
    tmp_path: Path,
) -> None:
    path, link = tmp_path / "ledger.json", tmp_path / "link"
    path.write_text("{}")
    link.symlink_to(path)
    before = file_stamp(path)
    new = tmp_path / "new"
    new.write_text("{}")
    os.replace(new, path)
    assert file_stamp(path) != before
    assert file_stamp(link) == file_stamp(path)
    assert file_stamp(link, follow=False) != file_stamp(path)
    assert file_stamp(path, owner=os.getuid() + 1) is None
    assert file_stamp(tmp_path / "missing") is None
