"""README.md and docs/: every command shown runs against simulated GPUs, every config example is
read by gpuwait's own parser, and the reference tables list exactly what the code has.

A page's shell blocks run in order in one bash process (see helpers/docs.py for the markers a
page may use), in a fresh home, from a directory laid out like the top of a clone.
"""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path

import pytest
from conftest import REPO
from helpers import docs

from gpuwait import config
from gpuwait.core import errors

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGE_IDS = [str(p.relative_to(REPO)) for p in PAGES]


def page_blocks(page: Path) -> list[docs.Block]:
    return docs.blocks(page, str(page.relative_to(REPO)))


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_page_has_commands_that_run_and_marks_every_other_block(page: Path) -> None:
    found = page_blocks(page)  # raises on an unfenced, unlabelled or badly marked block
    runnable = [b for b in found if b.language == docs.SHELL and b.skip is None]
    assert runnable, f"{page.name} shows no command that its test runs"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_page_commands_run_on_the_simulation(page: Path, tmp_path: Path) -> None:
    docs.assert_page_runs(page, tmp_path)


def all_blocks(language: str) -> list[docs.Block]:
    """For parametrizing: a page that cannot be read is reported by its own test above."""
    found = []
    for page in PAGES:
        with contextlib.suppress(ValueError):
            found += [b for b in page_blocks(page) if b.language == language and not b.skip]
    return found


@pytest.mark.parametrize("block", all_blocks("toml"), ids=lambda b: b.where)
def test_toml_example_is_read_by_gpuwait(block: docs.Block, tmp_path: Path) -> None:
    path = tmp_path / "example.toml"
    path.write_text(block.text)
    if "[[gpu]]" in block.text:
        from gpuwait.gpu.sim import SimBackend

        assert SimBackend(str(path)).snapshot().gpus
        return
    values = config.load_config_file(path, site=block.site_config)
    assert values, f"{block.where}: the example sets nothing"
    if block.site_config:
        config.resolve({}, {}, {}, tmp_path / "none.toml", values, path)
    else:
        config.resolve({}, {}, values, path)


@pytest.mark.parametrize("block", all_blocks("python"), ids=lambda b: b.where)
def test_python_example_compiles(block: docs.Block) -> None:
    compile(block.text, block.where, "exec")


def table(page: Path, first_header: str) -> list[list[str]]:
    """The rows of the page's table whose header starts with `first_header`, as cell texts."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def test_configuration_table_lists_every_setting_once_as_the_code_has_it() -> None:
    from gpuwait.commands.run import build_parser

    flags = {s for action in build_parser()._actions for s in action.option_strings}
    rows = table(REPO / "docs" / "configuration.md", "setting")
    names = [row[0].strip("`") for row in rows]
    assert sorted(names) == sorted(o.name for o in config.OPTIONS)
    assert len(names) == len(set(names))
    for row in rows:
        option = config.OPTIONS_BY_NAME[row[0].strip("`")]
        flag = config._flag(option.name)
        assert row[1] == (f"`{flag}`" if flag in flags else "—"), row
        assert row[2] == ("— (site file only)" if option.site_only else f"`{option.env_var}`"), row
        assert row[3] == f"`{option.show(option.parse(option.default))}`", row
        assert row[4], row


def test_exit_code_table_lists_every_code_of_gpuwait_and_no_other() -> None:
    rows = table(REPO / "docs" / "exit-codes.md", "code")
    codes = [int(code) for row in rows for code in re.findall(r"\b[0-9]+\b", row[0])]
    defined = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    # Interrupted while waiting: 128 + the signal, as shells report it.
    interrupted = {128 + signal.SIGINT, 128 + signal.SIGTERM}
    assert sorted(codes) == sorted(defined | interrupted)
    assert rows[0][0] == "the command's"


def test_readme_keeps_the_test_command_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    command = (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
        ".venv/bin/python -m pytest -n auto\n"
    )
    assert command in readme
    assert (
        ".venv/bin/python -m pytest -p no:cacheprovider -n auto\n"
        in (REPO / ".ci" / "run").read_text()
    )


def test_links_between_pages_lead_to_files_that_exist() -> None:
    for page in [*PAGES, *sorted((REPO / "contrib").glob("*/README.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)}: {target}"


def test_quick_start_sim_file_is_the_readers_own() -> None:
    readme = (REPO / "README.md").read_text()
    assert 'GPUWAIT_SIM="$HOME/' in readme
    assert not re.search(r"sim init[^\n]*/tmp/", readme)


def test_one_readme_command_installs_gpuwait_and_runs_it() -> None:
    """The set-up is one command; the tests run all of it but the install."""
    readme = REPO / "README.md"
    (line,) = [line for line in readme.read_text().splitlines() if line.startswith(docs.INSTALL)]
    assert line.endswith("gpuwait status")
    rest = line.removeprefix(docs.INSTALL) + "\n"
    assert [b for b in docs.blocks(readme) if b.text == rest and b.skip is None]


def test_usage_summary_names_every_subcommand() -> None:
    from gpuwait.commands import SUBCOMMANDS

    usage = REPO / "docs" / "usage.md"
    summary = next(b for b in docs.blocks(usage) if b.language == "text")
    shown = {line.split()[1] for line in summary.text.splitlines() if line.startswith("gpuwait ")}
    assert set(SUBCOMMANDS) <= shown, sorted(set(SUBCOMMANDS) - shown)
