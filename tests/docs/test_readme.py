"""The README as a first page: its size, where a newcomer finds what, its headline figures, and every `steerspec`
command it and docs/ show accepted by the real parser (`steerspec.cli.build_parser`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from typing import List, Tuple

import pytest

from markdown_scan import ROOT, Command, commands, markdown_files
from steerspec.cli import build_parser

README = ROOT / "README.md"
FIRST_LINES = 120
NEEDED_EARLY = ("## Install", "## Run on one machine", "## Deploy on several hosts", "## The SDK")


def readme_lines() -> List[str]:
    return README.read_text(encoding="utf-8").splitlines()


def test_readme_is_at_most_200_lines_none_over_200_characters():
    lines = readme_lines()
    assert len(lines) <= 200
    assert [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 200] == []


def test_install_run_deploy_and_sdk_come_within_the_first_120_lines():
    first = readme_lines()[:FIRST_LINES]
    assert [h for h in NEEDED_EARLY if h not in first] == []


def test_each_headline_figure_names_its_command_machine_and_results_page():
    lines = readme_lines()
    start = lines.index("## Headline figures")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    figures = [line for line in lines[start:end] if line.startswith("- **")]
    assert 4 <= len(figures) <= 6
    for line in figures:
        assert re.search(r"`steerspec [^`]+`", line), line
        assert re.search(r"AMD EPYC|Intel Xeon|\bVM\b|H100|H200|GPU", line), line
        assert re.search(r"\]\(docs/results/[\w-]+\.md\)", line), line


def subcommand_parsers(parser: argparse.ArgumentParser, words: List[str]) -> Tuple[List[argparse.ArgumentParser], str]:
    """The parsers a command's leading words select (`a|b` selects both), and a refusal when a word names none."""
    current, used = [parser], []
    for word in words:
        groups = [a for a in current[0]._actions if isinstance(a, argparse._SubParsersAction)]
        if not groups or word.startswith("-"):
            break
        choices = groups[0].choices
        names = word.split("|")
        unknown = [n for n in names if n not in choices]
        if unknown:
            return current, f"`steerspec {' '.join(used + [word])}`: no command {unknown} (known: {sorted(choices)})"
        current, used = [choices[n] for n in names], used + [word]
    return current, ""


def refusals(parser: argparse.ArgumentParser, command: Command) -> List[str]:
    """Why a shown command would not run as written: an unknown command or flag, or (a whole line) argparse's
    own error."""
    page = command.path.relative_to(ROOT) if command.path.is_relative_to(ROOT) else command.path.name
    where = f"{page}:{command.line}: {command.text}"
    words = command.words()
    selected, unknown_command = subcommand_parsers(parser, words)
    if unknown_command:
        return [f"{where}: {unknown_command}"]
    problems = []
    for flag in re.findall(r"(?<![\w-])--[A-Za-z0-9][\w-]*", " ".join(words)):
        for sub in selected:
            if flag not in sub._option_string_actions:
                problems.append(f"{where}: {sub.prog} has no {flag}")
    if command.complete and not problems:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(list(command.argv()))
        except SystemExit as exc:
            if exc.code:
                problems.append(f"{where}: {err.getvalue().strip()}")
    return problems


@pytest.fixture(scope="module")
def cli_parser() -> argparse.ArgumentParser:
    return build_parser()


def test_every_steerspec_command_in_the_readme_parses(cli_parser):
    shown = commands(README)
    assert sum(c.complete for c in shown) >= 8  # the one-machine runs and the recipe, at least
    assert [p for c in shown for p in refusals(cli_parser, c)] == []


def test_every_steerspec_command_under_docs_uses_flags_its_command_has(cli_parser):
    shown = [c for page in markdown_files()[1:] for c in commands(page)]
    assert [p for c in shown for p in refusals(cli_parser, c)] == []


def test_a_wrong_flag_a_wrong_command_and_a_missing_argument_are_caught(cli_parser, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nsteerspec run \"x\" --no-such-flag\nsteerspec serve verifer --port 1\n"
                    "steerspec run --k 4\n```\nand `steerspec bench remote --rtt-ms 50 --nope …`\n", encoding="utf-8")
    found = [p for c in commands(page) for p in refusals(cli_parser, c)]
    assert len(found) == 4
    assert "has no --no-such-flag" in found[0]
    assert "no command ['verifer']" in found[1]
    assert "required: prompt" in found[2]
    assert "has no --nope" in found[3]
