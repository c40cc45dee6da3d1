"""The how-to pages' code blocks, each page run as a reader would (tests/support/doc_blocks.py has the
rules): a file of their own, so the two test workers share the docs' pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.doc_blocks import DOCS, ROOT, assert_page_runs, blocks

PAGES = [
    page for page in sorted((DOCS / "how-to").glob("*.md")) if any(b.kind == "run" for b in blocks(page))
]


def test_every_verb_has_a_page_whose_blocks_run() -> None:
    assert len(PAGES) >= 14, PAGES


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_page_blocks_run(page: Path, tmp_path: Path) -> None:
    assert_page_runs(page, tmp_path)
