"""Telling a changed file from the one last looked at, without reading it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


def test_a_listing_is_kept_only_once_the_directory_was_seen_unchanged_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A shared ledger directory on a file server whose clock is behind this machine's: its
    # last change looks seconds old at once, and a change in the same tick of the server's
    # clock (a member's first ledger file, renamed in just after its temporary file was made)
    # leaves the directory's stamp as it was. A listing taken between the two was kept, and
    # the member's new file went unseen, its room handed out again, until the directory
    # changed once more. A listing is kept only from a look begun once this process has seen
    # the same stamp for RACY_SECONDS by its own clock.
    from gpuwait.linux import stamp as module

    frozen = module.file_stamp(tmp_path)
    assert frozen is not None
    monkeypatch.setattr(module, "file_stamp", lambda path, **_: frozen)
    monkeypatch.setattr(module, "may_change_unseen", lambda _: False)  # the server's clock
    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    kept = module.NotTheirs()
    kept.begin(tmp_path)
    kept.keep(["before the member's file"])
    clock[0] += 0.5
    kept.begin(tmp_path)  # the member's file made meanwhile, the stamp the same
    assert kept.listed is None  # listed afresh: the new file is found
    kept.keep(["with the member's file"])
    clock[0] += module.RACY_SECONDS
    kept.begin(tmp_path)
    kept.keep(["with the member's file"])
    clock[0] += 0.5
    kept.begin(tmp_path)
    assert kept.listed == ["with the member's file"]  # kept once the stamp stood still
