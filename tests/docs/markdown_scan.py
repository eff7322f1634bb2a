"""Reading the repository's Markdown as GitHub renders it: links, heading anchors and `steerspec` command lines.

Pure text functions (no imports of the package), shared by the docs tests.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
COMMAND_START = re.compile(r"^(?:python3? -m )?steerspec(?=\s|$)")
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")


def markdown_files() -> List[Path]:
    """The README and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def paragraphs(text: str) -> Iterator[Tuple[int, str]]:
    """(first line number, text) of each paragraph outside fenced code blocks (a code span may cross its lines)."""
    fenced, start, block = False, 0, []
    for number, line in enumerate(text.splitlines() + [""], 1):
        if FENCE.match(line) or not line.strip() or fenced:
            if block:
                yield start, "\n".join(block)
                block = []
            if FENCE.match(line):
                fenced = not fenced
            continue
        if not block:
            start = number
        block.append(line)


def code_spans(paragraph: str) -> Iterator[Tuple[int, str]]:
    """(line offset in the paragraph, content) of each inline code span, its line breaks read as spaces."""
    for m in INLINE_CODE.finditer(paragraph):
        yield paragraph.count("\n", 0, m.start()), " ".join(m.group(2).split())


def links(text: str) -> List[Tuple[int, str]]:
    """(line number, target) of every Markdown link and image in prose, code spans left out."""
    found = []
    for start, paragraph in paragraphs(text):
        blanked = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), paragraph)
        for offset, line in enumerate(blanked.split("\n")):
            found += [(start + offset, m.group(1)) for m in LINK.finditer(line)]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> Set[str]:
    """Every heading anchor of a page, duplicates numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict = {}
    found: Set[str] = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


@dataclass(frozen=True)
class Command:
    """One `steerspec ...` command shown in a page. `complete`: a whole line of a code block (an inline mention
    may leave out a required argument, and a synopsis shows alternatives)."""

    path: Path
    line: int
    text: str
    complete: bool

    def argv(self) -> Tuple[str, ...]:
        """The arguments after `steerspec`, as a shell splits them, comments dropped, without a trailing `&` or
        `…` (more flags, given in full on the results page)."""
        words = shlex.split(COMMAND_START.sub("", self.text.strip()), comments=True)
        while words and words[-1] in ("&", "…"):
            words.pop()
        return tuple(words)

    def words(self) -> List[str]:
        """The command's words without a shell comment; alternatives (`a|b`) kept as one word."""
        body = COMMAND_START.sub("", self.text.replace("\\|", "|").strip())
        try:
            return list(self.argv()) if self.complete else shlex.split(body, comments=True)
        except ValueError:  # an inline mention with shell syntax shlex cannot split: plain words will do
            return re.sub(r"\s#\s.*$", "", body).split()


def commands(path: Path) -> List[Command]:
    """Every `steerspec` command of a page: whole lines in code blocks (continuations joined; complete in shell
    blocks) and inline code spans."""
    found: List[Command] = []
    fenced, runnable, pending, start = False, False, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced, pending = not fenced, ""
            runnable = line.strip().lstrip("`~").strip() in SHELL_BLOCKS  # a `text` block shows a synopsis
            continue
        if fenced:
            if not pending:
                start = number
                line = re.sub(r"^\s*\$\s+", "", line)  # a `$ ` prompt before a command in shown output
                if not COMMAND_START.match(line.strip()):
                    continue
            pending += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                found.append(Command(path, start, pending.strip(), runnable))
                pending = ""
    for start, paragraph in paragraphs(path.read_text(encoding="utf-8")):
        for offset, span in code_spans(paragraph):
            if COMMAND_START.match(span):
                found.append(Command(path, start + offset, span, False))
    return found
