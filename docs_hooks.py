"""mkdocs hooks (mkdocs.yml `hooks:`): the docs site's home page is the README.

docs/index.md is the list of every guide (tests/test_docs.py keeps it complete against the
navigation). On the site, README.md's text, its `docs/...` links made relative to the docs
folder, is put above that list: the front door (the first command, the walkthrough, the
command table, the measured results) and every guide on one page.
"""

import re
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"
MARKER = "<!-- home: README.md above -->"
# Markdown links and images whose target starts with docs/ (the README's view of the site).
DOCS_LINK = re.compile(r"(\]\(\s*<?)docs/")


def readme_as_home(readme: str) -> str:
    """README.md's Markdown with its `docs/...` link targets relative to the docs folder."""
    return DOCS_LINK.sub(r"\1", readme)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return readme_as_home(README.read_text()) + "\n" + markdown.split(MARKER, 1)[1]
