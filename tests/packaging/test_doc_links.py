"""Every relative Markdown link in README.md and docs/ leads to a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(text: str) -> list[str]:
    """The targets of the Markdown links in ``text``, fenced code blocks left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_links_and_slug_hand_made():
    text = 'See [a](docs/A.md#x), ![p](f.png "t") and [`b`](https://x.org).\n```\n[c](no.md)\n```\n'
    assert links(text) == ["docs/A.md#x", "f.png", "https://x.org"]
    assert slug("Running this repository (`make run`)") == "running-this-repository-make-run"
    assert slug("3. TLS") == "3-tls"


def test_every_local_link_resolves():
    assert len(PAGES) >= 10
    broken = []
    for page in PAGES:
        for target in links(page.read_text()):
            if re.match(r"^[a-z][a-z+.-]*:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_flower_is_cited_by_its_current_repository():
    # Flower moved from adap/flower to flwrlabs/flower (GitHub redirects the old name):
    # every link to Flower's repository uses the current one, so the docs agree.
    pages = [*PAGES, *sorted((ROOT / "examples").glob("*/README.md"))]
    old = [
        f"{page.relative_to(ROOT)}: github.com/{owner}/flower"
        for page in pages
        for owner in re.findall(r"github\.com/([\w.-]+)/flower\b", page.read_text())
        if owner != "flwrlabs"
    ]
    assert old == []
