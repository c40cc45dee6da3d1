"""Every code block of the README and the docs, run as a reader would run it.

A page's blocks run in order, each in a fresh process, in one scratch folder for the page: a later block
may use what an earlier one of the same page wrote, and nothing else is there (no checkout, no network, no
GPU). What a block is follows from its fence's info string and its first line:

- ```python / ```bash: run (``python block.py``; ``bash -euo pipefail``, the venv's bin first on PATH) and
  must exit 0, or the code its first line names (``# expect exit 2``);
- a title (```python title="models.py"```): written to that file for later blocks, not run (Python is
  compiled, so a broken module fails here, not in the block that imports it);
- ```text, ```json, ```jsonc, ```yaml, ```toml without a title: output or data shown to the reader;
- a first line ``# fragment: how-to/load.md``: a piece that needs what a page cannot make here (CUDA,
  several machines, a download, a checkout); the page under docs/ that completes it must exist. Python
  fragments are compiled.

``python -m tests.support.doc_blocks PAGE...`` runs pages and prints each block's line, verdict and time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
ROOT_PAGES = ("README.md", "CONTRIBUTING.md", "SECURITY.md", "CHANGELOG.md")
RUN = {"python", "bash"}
SHOWN = {"text", "json", "jsonc", "yaml", "toml"}
BLOCK_TIMEOUT_S = 300
OUTPUT_TAIL = 4000

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_TITLE = re.compile(r'title="(?P<title>[^"]*)"')
_FRAGMENT = re.compile(r"#\s*fragment:\s*(?P<page>\S+)(\s.*)?")
_EXPECT = re.compile(r"#\s*expect exit (?P<code>\d+)\s*$")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """the line of the opening fence, counted from 1"""
    language: str
    title: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{_shown(self.page)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0].strip()

    @property
    def fragment_of(self) -> str | None:
        """the page (under docs/) a fragment names as the one that completes it"""
        match = _FRAGMENT.fullmatch(self.first_line)
        return match["page"] if match else None

    @property
    def kind(self) -> str:
        """run, file, shown or fragment"""
        if self.title is not None:
            return "file"
        if self.language in SHOWN:
            return "shown"
        if self.fragment_of is not None:
            return "fragment"
        return "run"

    @property
    def expected_exit(self) -> int:
        match = _EXPECT.fullmatch(self.first_line)
        return int(match["code"]) if match else 0


@dataclass(frozen=True)
class Outcome:
    block: Block
    ok: bool
    seconds: float
    detail: str


def pages() -> list[Path]:
    """the README, the project's own pages at the root, and every page of the docs site"""
    found = [ROOT / name for name in ROOT_PAGES if (ROOT / name).exists()]
    return found + sorted(DOCS.rglob("*.md"))


def blocks(page: Path) -> list[Block]:
    """the fenced blocks of a Markdown page (a fence closes on the same character, at least as long)"""
    lines = page.read_text(encoding="utf-8").split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, info = len(opening["indent"]), opening["fence"], opening["info"].strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            closes = closing is not None and not closing["info"].strip()
            if closes and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence):
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        language = info.split()[0].lstrip("{.").rstrip("}") if info else ""
        title = _TITLE.search(info)
        found.append(Block(page, i + 1, language, title["title"] if title else None, "\n".join(body) + "\n"))
        i = j + 1
    return found


def problems(block: Block) -> list[str]:
    """what is wrong with a block before running anything: its language, its fragment's page, its syntax"""
    if not block.language:
        return [f"{block.where}: a block needs a language after its fence (python, bash, text, json ...)"]
    if block.kind == "file":
        if not _FILE_NAME.fullmatch(block.title or "") or ".." in (block.title or ""):
            return [f"{block.where}: title {block.title!r} is not a relative file name"]
        return _syntax(block) if block.language == "python" else []
    if block.kind == "shown":
        return []
    if block.language not in RUN:
        known = ", ".join(sorted(RUN | SHOWN))
        return [f"{block.where}: language {block.language!r} is neither run nor shown ({known})"]
    if block.kind == "fragment":
        target = DOCS / (block.fragment_of or "")
        if not target.is_file():
            return [f"{block.where}: fragment names {block.fragment_of!r}, which is not a page under docs/"]
    return _syntax(block) if block.language == "python" else []


def _syntax(block: Block) -> list[str]:
    try:
        compile(block.code, block.where, "exec")
    except SyntaxError as error:
        named = f" in {block.title}" if block.title else ""
        return [f"{block.where}: {error.msg}{named} (block line {error.lineno})"]
    return []


def environment() -> dict[str, str]:
    """the reader's shell: this venv first on PATH, offline, no GPU, nothing of the checkout importable,
    one thread for torch"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_CURRENT_TEST")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
        MPLBACKEND="Agg",
        PYTHONDONTWRITEBYTECODE="1",
        COLUMNS="100",
        OMP_NUM_THREADS="1",  # the suite runs pages on two workers: torch's threads beside them thrash (50x)
    )
    return env


def run_page(page: Path, scratch: Path, timeout_s: float = BLOCK_TIMEOUT_S) -> Iterator[Outcome]:
    """run a page's blocks in order in ``scratch``; the first that fails ends the page (later blocks may
    need what it should have made)"""
    env = environment()
    for block in blocks(page):
        found = problems(block)
        if found:
            yield Outcome(block, False, 0.0, "; ".join(found))
            return
        if block.kind == "file":
            target = scratch / (block.title or "")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code, encoding="utf-8")
            continue
        if block.kind != "run":
            continue
        outcome = _run(block, scratch, env, timeout_s)
        yield outcome
        if not outcome.ok:
            return


def assert_page_runs(page: Path, scratch: Path) -> None:
    """the test of one page: every block runs, the first failure named with its output"""
    outcomes = list(run_page(page, scratch))
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{failed[0].block.where} ({failed[0].block.language}): {failed[0].detail}"
    assert outcomes, f"{_shown(page)}: no block ran"


def _run(block: Block, scratch: Path, env: dict[str, str], timeout_s: float) -> Outcome:
    suffix = ".py" if block.language == "python" else ".sh"
    with tempfile.NamedTemporaryFile("w", suffix=suffix, dir=scratch, delete=False, prefix=".block-") as f:
        f.write(block.code)
    script = Path(f.name)
    command = (
        [sys.executable, script.name]
        if block.language == "python"
        else ["bash", "-euo", "pipefail", script.name]
    )
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=scratch,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return Outcome(
            block, False, time.perf_counter() - start, f"no exit within {timeout_s:.0f} s\n{_tail(output)}"
        )
    finally:
        script.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    if process.returncode != block.expected_exit:
        said = f"exit {process.returncode}, expected {block.expected_exit}"
        return Outcome(block, False, seconds, f"{said}\n{_tail(output)}")
    return Outcome(block, True, seconds, "")


def _tail(output: bytes) -> str:
    text = output.decode("utf-8", "replace")
    return text if len(text) <= OUTPUT_TAIL else "...\n" + text[-OUTPUT_TAIL:]


def _shown(page: Path) -> str:
    try:
        return str(page.relative_to(ROOT))
    except ValueError:
        return str(page)


def main(argv: list[str]) -> int:
    chosen = [Path(a).resolve() for a in argv] or pages()
    failed = 0
    for page in chosen:
        with tempfile.TemporaryDirectory(prefix="doc-blocks-") as scratch:
            total = 0.0
            counts = {"file": 0, "shown": 0, "fragment": 0}
            for block in blocks(page):
                if block.kind in counts:
                    counts[block.kind] += 1
            ran = 0
            for outcome in run_page(page, Path(scratch)):
                ran += 1
                total += outcome.seconds
                verdict = "ok  " if outcome.ok else "FAIL"
                print(f"{verdict} {outcome.block.where} {outcome.block.language} {outcome.seconds:6.1f} s")
                if not outcome.ok:
                    failed += 1
                    print(outcome.detail)
            tally = ", ".join(f"{n} {kind}" for kind, n in counts.items())
            print(f"{_shown(page)}: {ran} run in {total:.1f} s; {tally}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
