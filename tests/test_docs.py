"""The docs: README.md stays a front door, every relative link in it and under docs/ leads to
a file (and heading) that exists, and the mkdocs site builds with warnings as errors."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.S | re.M)
CODE = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def relative_links(page: Path) -> list[str]:
    """Link and image targets of a Markdown page, outside code, that are not URLs."""
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return [t for t in LINK.findall(text) if not EXTERNAL.match(t)]


def heading_ids(page: Path) -> set[str]:
    """The anchors Python-Markdown's toc (what mkdocs uses) gives the page's headings."""
    markdown = pytest.importorskip("markdown", reason="heading anchors need Python-Markdown")
    md = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
    md.convert(page.read_text())
    ids, stack = set(), list(md.toc_tokens)
    while stack:
        token = stack.pop()
        ids.add(token["id"])
        stack.extend(token["children"])
    return ids


def test_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 260, f"README.md has {lines} lines; guides belong under docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in heading_ids(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_mkdocs_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs site needs mkdocs (pip install -e '.[docs]')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert (tmp_path / "index.html").is_file()
