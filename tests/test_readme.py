"""The README is a short guide whose commands, links and drafter table hold."""

import re
from pathlib import Path

import pytest

from dflash_mlx.drafters import KNOWN_DRAFTERS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = [README, ROOT / "convert" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    return {slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def relative_links(path: Path) -> list:
    return [t for t in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", t)]


def test_readme_is_short_and_keeps_both_fresh_machine_commands():
    text = README.read_text()
    assert len(text.splitlines()) < 250
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && mlx-dflash generate" in text
    assert 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest' in text


@pytest.mark.parametrize("guide", GUIDES, ids=[str(g.relative_to(ROOT)) for g in GUIDES])
def test_every_link_leads_to_a_file_and_heading_that_exist(guide):
    links = relative_links(guide)
    assert guide != README or len(links) >= 10  # the README links its docs
    for link in links:
        target, _, anchor = link.partition("#")
        path = (guide.parent / target).resolve() if target else guide
        assert path.exists(), f"{guide.name}: {link} -> missing {path}"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{guide.name}: {link} -> no heading #{anchor} in {path.name}"


def test_every_doc_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    assert not [g for g in GUIDES[1:] if g.resolve() not in linked]


def test_the_readme_drafter_table_is_the_known_drafter_table():
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)`", README.read_text(), re.MULTILINE)
    assert dict(rows) == KNOWN_DRAFTERS and len(rows) == len(KNOWN_DRAFTERS)


def test_slug_follows_github():
    assert slug(" Past one Mac: `--pipeline`") == "past-one-mac---pipeline"
    assert slug("SmolLM2 pair (real model): DFlash against autoregressive") == (
        "smollm2-pair-real-model-dflash-against-autoregressive")
