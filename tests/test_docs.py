"""The docs: README.md stays a front door, every relative link in it and under docs/ leads to
a file (and heading) that exists, and the mkdocs site builds with warnings as errors."""

import html
import re
import shutil
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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The docs site, built with warnings as errors."""
    pytest.importorskip("mkdocs", reason="the docs site needs mkdocs (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return out


def test_mkdocs_builds_strict(site):
    assert (site / "index.html").is_file()


def guide_pages() -> list[str]:
    """Every page of the navigation's Guides and Reference sections (mkdocs.yml)."""
    yaml = pytest.importorskip("yaml")
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    sections = {k: v for entry in nav if isinstance(entry, dict) for k, v in entry.items()}
    return [page for name in ("Guides", "Reference") for e in sections[name] for page in e.values()]


def test_home_page_links_every_guide():
    pages = guide_pages()
    linked = set(relative_links(ROOT / "docs" / "index.md"))
    assert len(pages) > 20
    assert [p for p in pages if p not in linked] == []


def test_home_page_is_the_readme(site):
    """The site's front door is the README: its first command, the walkthrough, the command
    table and the Python snippet, with the README's docs/ links working on the site."""
    home = (site / "index.html").read_text()
    text = html.unescape(re.sub(r"<[^>]+>", "", home))
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n", readme).group(1)
    for needed in (first, "from jaxmoe import TrainedModel", "jaxmoe convert gqa ckpt/t5"):
        assert needed in text, needed
    table = re.search(r"<table>.*?</table>", home, re.S).group(0)
    assert "convert hf" in table and "analyze-routing" in table
    assert 'href="training.html#when-things-go-wrong"' in home
    assert "docs/" not in re.findall(r'href="([^"]+)"', home)[0]
    for page in guide_pages():
        assert f'href="{page.replace(".md", ".html")}"' in home, page


def chromium() -> str | None:
    return next(
        (shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None
    )


@pytest.mark.slow  # Chromium takes 5-80 s to start on a loaded 2-core host
def test_home_page_screenshot_in_headless_chromium(site, tmp_path):
    """The home page as a browser draws it: a screenshot with text on it, and long commands
    wrapped (docs/css/wrap_code.css) so the first command is seen whole. .ci/run installs
    Debian's chromium."""
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium on PATH (apt-get install -y chromium; .ci/run installs it)")
    assert "css/wrap_code.css" in (site / "index.html").read_text()
    shot = tmp_path / "home.png"
    run = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--screenshot={shot}", "--window-size=1280,1600", (site / "index.html").as_uri()],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert shot.is_file(), run.stderr[-2000:]
    from matplotlib import image

    pixels = image.imread(shot)
    assert pixels.shape[:2] == (1600, 1280)
    gray = pixels[..., :3].mean(axis=-1)
    assert (gray < 0.5).mean() > 0.005, "no dark (text) pixels: a blank page"
    assert (gray > 0.9).mean() > 0.3, "no light background: not the page"
