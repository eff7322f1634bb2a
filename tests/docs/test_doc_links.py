"""Every relative link in the README and under docs/ resolves: the file or folder exists inside the repository,
and an `#anchor` names a heading of its page as GitHub renders it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

import pytest

from markdown_scan import ROOT, anchors, links, markdown_files, slug

EXTERNAL = ("http://", "https://", "mailto:")


def broken_links(page: Path) -> list:
    """'page:line: target (why)' for each relative link of a page that does not resolve."""
    text = page.read_text(encoding="utf-8")
    broken = []
    for number, target in links(text):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.is_relative_to(ROOT):
            broken.append(f"{where} (outside the repository)")
        elif not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{where} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    assert broken_links(page) == []


def test_the_checker_catches_a_missing_file_a_missing_anchor_and_a_path_outside(tmp_path):
    page = ROOT / "docs" / "results" / "engine.md"
    text = ("[a](data/engine/no-such-run.json) [b](../guides/cli.md#no-such-heading) [c](../../../shared/DESIGN.md) "
            "[d](../guides/cli.md#steerspec-run) [e](https://example.com/x.md)\n")
    fake = page.parent / "__scan_probe__.md"
    try:
        fake.write_text(text, encoding="utf-8")
        whys = [entry.rsplit("(", 1)[1] for entry in broken_links(fake)]
    finally:
        fake.unlink()
    assert whys == ["no such file)", "no heading with that anchor)", "outside the repository)"]


def test_anchors_follow_githubs_rules():
    assert slug("Deploy on several hosts") == "deploy-on-several-hosts"
    assert slug("`steerspec run`") == "steerspec-run"
    assert slug("4. Observability (`observability/`)") == "4-observability-observability"
    assert slug("Security: TLS, tokens, ownership") == "security-tls-tokens-ownership"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
