"""The documents a newcomer walks: every relative link in the README, the
guide, the design notes, the results and CONTRIBUTING leads to a file that
exists, and every #anchor to a heading there; no document names a path
outside the repository."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md",
               ROOT / "docker" / "README.md"])


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"(?m)^#+ (.*)$", path.read_text())}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_somewhere(doc):
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        assert target.exists(), f"{doc.relative_to(ROOT)} links to {link}, which is not here"
        assert ROOT in target.parents or target == ROOT, f"{link} leads out of the repository"
        if anchor:
            assert anchor in anchors(target), f"{doc.relative_to(ROOT)}: no heading #{anchor} in {path}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_outside_the_repository(doc):
    text = doc.read_text()
    for outside in ("../shared", "/work/", "reference.md", "reference section"):
        assert outside not in text, f"{doc.relative_to(ROOT)} names {outside!r}"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 200
