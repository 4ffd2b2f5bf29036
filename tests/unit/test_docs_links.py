"""Every relative link in README.md and docs/**/*.md leads somewhere: the file or folder
exists, and a `#anchor` names a heading of the page it points to, by GitHub's rules for
heading anchors (lower case; punctuation but `-` and `_` dropped; each space a `-`; a
repeated heading gets `-1`, `-2`, ...). Links to other sites are not followed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
# [text](target) and ![alt](target); the text may wrap onto the next lines
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def prose(text: str) -> str:
    """The page without its fenced code blocks (kept as blank lines, so that line
    numbers stay), where `[x](y)` and `# x` are code, not links or headings."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before the `-N` of a repeat)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).lower()  # inline HTML
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page has: its headings' slugs (repeats numbered), and <a name=...>."""
    text = prose(page.read_text())
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for match in HEADING.finditer(text):
        slug = github_slug(match.group(2))
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """`page:line: target (why)` for each relative link of the page that leads nowhere."""
    text = prose(page.read_text())
    text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    problems = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        line = text.count("\n", 0, match.start()) + 1
        path, _, anchor = target.partition("#")
        goal = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO)}:{line}: {target}"
        if not goal.exists():
            problems.append(f"{where} (no file {path})")
        elif anchor and goal.suffix == ".md" and anchor not in anchors(goal):
            problems.append(f"{where} (no heading of {goal.name} has the anchor #{anchor})")
    return problems


def test_github_slug_follows_githubs_rules():
    assert (
        github_slug("The loss in chunks (`loss.num_chunks`)") == "the-loss-in-chunks-lossnum_chunks"
    )
    assert github_slug("`freetx doctor [--nproc-per-node N]`") == "freetx-doctor---nproc-per-node-n"
    assert github_slug("Gemma 3's multimodal folders") == "gemma-3s-multimodal-folders"
    assert github_slug("See [data](data.md): packing") == "see-data-packing"


def test_repeated_heading_gets_a_number(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Faults\n\n## Faults\n\n```\n# Faults\n```\n\n## Faults\n")
    assert anchors(page) == {"faults", "faults-1", "faults-2"}


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "other.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading) [gone](missing.md) [bad\nanchor](other.md#b-heading)\n"
        "`[code](missing.md)` [self](#nowhere)\n\n```\n[fenced](missing.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md:1: missing.md (no file missing.md)",
        "page.md:1: other.md#b-heading (no heading of other.md has the anchor #b-heading)",
        "page.md:3: #nowhere (no heading of page.md has the anchor #nowhere)",
    ]


def test_every_relative_link_of_the_docs_resolves():
    assert len(PAGES) > 10, PAGES
    problems = [problem for page in PAGES for problem in broken_links(page)]
    assert not problems, "links that lead nowhere:\n" + "\n".join(problems)
