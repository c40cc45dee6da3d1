"""The README's and the docs' code blocks: each runs as written (tests/support/doc_blocks.py has the rules),
or says what it is (output shown, a file written, a fragment naming the page that completes it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import doc_blocks
from tests.support.doc_blocks import ROOT, blocks, pages, problems, run_page

RUNNABLE = [page for page in pages() if any(block.kind == "run" for block in blocks(page))]
HOW_TO = doc_blocks.DOCS / "how-to"  # those pages run in tests/test_doc_blocks_howto.py: a second worker


def test_every_block_is_run_shown_written_or_a_fragment() -> None:
    found = [problem for page in pages() for block in blocks(page) for problem in problems(block)]
    assert not found, "\n".join(found)


def test_the_readme_and_the_docs_have_blocks_that_run() -> None:
    # the pages are found where they are (an empty list would pass every test above)
    assert ROOT / "README.md" in RUNNABLE
    assert any(page.is_relative_to(doc_blocks.DOCS) for page in RUNNABLE)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    [p for p in RUNNABLE if not p.is_relative_to(HOW_TO)],
    ids=lambda page: str(page.relative_to(ROOT)),
)
def test_page_blocks_run(page: Path, tmp_path: Path) -> None:
    doc_blocks.assert_page_runs(page, tmp_path)


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    (tmp_path / "scratch").mkdir()
    return page


def test_a_failing_block_fails_its_page_and_stops_it(tmp_path: Path) -> None:
    page = _page(
        tmp_path, "```bash\necho one > one.txt\n```\n\n```bash\nexit 3\n```\n\n```bash\ntouch never\n```\n"
    )
    outcomes = list(run_page(page, tmp_path / "scratch"))
    assert [o.ok for o in outcomes] == [True, False]
    assert "exit 3, expected 0" in outcomes[1].detail
    assert not (tmp_path / "scratch" / "never").exists()


def test_blocks_share_the_page_folder_and_titled_blocks_are_files(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        '```python title="shapes.py"\nSIDE = 3\n```\n\n'
        "```python\nimport shapes\nopen('area.txt', 'w').write(str(shapes.SIDE ** 2))\n```\n\n"
        '```bash\ntest "$(cat area.txt)" = 9\n```\n',
    )
    outcomes = list(run_page(page, tmp_path / "scratch"))
    assert [o.ok for o in outcomes] == [True, True], [o.detail for o in outcomes]


def test_an_expected_exit_must_happen(tmp_path: Path) -> None:
    page = _page(tmp_path, "```bash\n# expect exit 2\nexit 2\n```\n\n```bash\n# expect exit 2\ntrue\n```\n")
    outcomes = list(run_page(page, tmp_path / "scratch"))
    assert [o.ok for o in outcomes] == [True, False]
    assert "exit 0, expected 2" in outcomes[1].detail


def test_blocks_run_without_the_checkout_on_the_path(tmp_path: Path) -> None:
    code = "import importlib.util, sys\nsys.exit(importlib.util.find_spec('tests') is not None)\n"
    page = _page(tmp_path, f"```python\n{code}```\n")
    assert [o.ok for o in run_page(page, tmp_path / "scratch")] == [True]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("```\nls\n```\n", "needs a language"),
        ("```ruby\nputs 1\n```\n", "neither run nor shown"),
        ("```bash\n# fragment: nowhere/at-all.md\nls\n```\n", "not a page under docs/"),
        ("```python\n# fragment: ARCHITECTURE.md\ndef broken(:\n```\n", "block line 2"),
        ('```python title="../escape.py"\nx = 1\n```\n', "not a relative file name"),
        ('```python title="mod.py"\nx = (\n```\n', "mod.py"),
    ],
)
def test_a_bad_block_is_named_before_anything_runs(tmp_path: Path, text: str, said: str) -> None:
    (found,) = [problem for block in blocks(_page(tmp_path, text)) for problem in problems(block)]
    assert said in found and "page.md:1" in found


def test_fences_nest_and_indent_as_commonmark_says(tmp_path: Path) -> None:
    in_a_list = "- a list item:\n\n    ```bash\n    echo in a list\n    ```\n\n"
    text = in_a_list + "````text\n```python\nnot run\n```\n````\n"
    found = blocks(_page(tmp_path, text))
    assert [(b.line, b.language, b.kind) for b in found] == [(3, "bash", "run"), (7, "text", "shown")]
    assert found[0].code == "echo in a list\n"
    assert "```python" in found[1].code
