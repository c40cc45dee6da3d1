"""Hostile work folders and recipes: the cases of tests/test_hostile_workfolder.py and
benchmarks.hostile."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from slimtorch.slimming.markers import MARKER, file_sha256
from tests.hostile import Case, Invocation, cases_of, strict
from tests.tiny_cnn import TINY

PRUNE, QUANTIZE = "02-prune", "05-quantize"


STAGES = ("01-baseline", "02-prune", "04-recover", "05-quantize", "06-save")


def _recipe_text(
    model: str, inputs: dict | None = None, options: dict | None = None, plan: dict | None = None
) -> str:
    """A recipe of the tiny model, its lines given as TOML text; ``None`` as a value drops that line."""
    tables = {
        "inputs": {"model": json.dumps(f"{model}:Tiny"), "data": '"digits"'},
        "options": {
            "goal": '"params=0.6"',
            "max_drop": "100.0",
            "recover_epochs": "1",
            "timings": "false",
            "attempts": "1",
            "seed": "0",
        },
        "plan": {"ratios": "[0.5]", "sparsities": "[0.0]", "schemes": '["int8-weight"]', "chosen": "0"},
    }
    for name, changes in (("inputs", inputs), ("options", options), ("plan", plan)):
        tables[name].update(changes or {})
    return "".join(
        f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in lines.items() if v is not None)
        for name, lines in tables.items()
    )


# -- the corpus: finished runs tampered with, then resumed --------------------------------------------------
def _reference(root: Path, seed: int) -> Path:
    """The work folder of a finished run of the tiny model (``seed``), made once under ``root`` by the
    command line in a process of its own."""
    references = root / "references"
    work = references / f"work-{seed}"
    if (work / STAGES[-1] / MARKER).exists():
        return work
    references.mkdir(exist_ok=True)
    (references / "tiny.py").write_text(TINY)
    recipe = references / f"recipe-{seed}.toml"
    recipe.write_text(_recipe_text(str(references / "tiny.py"), options={"seed": str(seed)}))
    command = [sys.executable, "-m", "slimtorch", "slim", "--recipe", str(recipe), "--work", str(work)]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return work


def _report(stdout: str) -> dict | None:
    try:
        report = json.loads(stdout)
    except ValueError:
        return None
    return report if isinstance(report, dict) and "stages" in report else None


def _resume_check(redone: tuple[str, ...], check_more: Callable[[dict], str | None] | None = None):
    """The check of a resume: every stage in ``redone`` is run again (never reported resumed) with a
    line saying why, every other stage of the reference is resumed, and the report is there."""

    def check(stdout: str, stderr: str) -> str | None:
        report = _report(stdout)
        if report is None:
            return "no report on stdout"
        status = {s["output"].split("/")[0]: s["status"] for s in report["stages"] if s["output"]}
        for stage in STAGES:
            if stage in redone and status.get(stage) != "done":
                return f"{stage} reported {status.get(stage)}, not redone"
            if stage in redone and f"slimtorch: note: {stage}: redone: " not in stderr:
                return f"no line says why {stage} was redone"
            if stage not in redone and status.get(stage) != "resumed":
                return f"{stage}, untouched, reported {status.get(stage)}, not resumed"
        return check_more(report) if check_more else None

    return check


def _after(stage: str) -> tuple[str, ...]:
    """``stage`` and every stage made from it."""
    return STAGES[STAGES.index(stage) :]


def _edit_marker(stage: str, edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    def tamper(work: Path, other: Path) -> None:
        path = work / stage / MARKER
        marker = json.loads(path.read_text())
        edit(marker)
        path.write_text(json.dumps(marker))

    return tamper


def _write(stage: str, name: str, data: bytes) -> Callable[[Path, Path], None]:
    def tamper(work: Path, other: Path) -> None:
        (work / stage / name).write_bytes(data)

    return tamper


def _swap(*stages: str, name: str | None = None) -> Callable[[Path, Path], None]:
    """Stage folders (or one file of each) taken from the other run."""

    def tamper(work: Path, other: Path) -> None:
        for stage in stages:
            if name is None:
                shutil.rmtree(work / stage)
                shutil.copytree(other / stage, work / stage)
            else:
                shutil.copyfile(other / stage / name, work / stage / name)

    return tamper


def _flip(stage: str, at: int = -1) -> Callable[[Path, Path], None]:
    def tamper(work: Path, other: Path) -> None:
        path = work / stage / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[at] ^= 0x01
        path.write_bytes(bytes(data))

    return tamper


def _truncate(stage: str) -> Callable[[Path, Path], None]:
    def tamper(work: Path, other: Path) -> None:
        path = work / stage / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return tamper


def _link_model(work: Path, other: Path) -> None:
    """02-prune's file replaced by a link to a copy of its own bytes: only the rule against links sees it."""
    model = work / "02-prune" / "model.safetensors"
    copy = work.parent / "elsewhere.safetensors"
    shutil.copyfile(model, copy)
    model.unlink()
    model.symlink_to(copy)


def _link_stage(work: Path, other: Path) -> None:
    """04-recover replaced by a link to a copy of the other run's: redone, and the copy left alone."""
    copy = work.parent / "linked-recover"
    shutil.copytree(other / "04-recover", copy)
    shutil.rmtree(work / "04-recover")
    (work / "04-recover").symlink_to(copy, target_is_directory=True)


def _file_for_stage(work: Path, other: Path) -> None:
    shutil.rmtree(work / "05-quantize")
    (work / "05-quantize").write_text("not a folder")


def _marker_link_to_dev_zero(work: Path, other: Path) -> None:
    (work / QUANTIZE / MARKER).unlink()
    (work / QUANTIZE / MARKER).symlink_to("/dev/zero")


def _marker_folder(work: Path, other: Path) -> None:
    (work / QUANTIZE / MARKER).unlink()
    (work / QUANTIZE / MARKER).mkdir()


def _old_marker(work: Path, other: Path) -> None:
    """done.json as slimtorch wrote it before markers were verified: the stage's result alone."""
    path = work / QUANTIZE / MARKER
    path.write_text(json.dumps(json.loads(path.read_text())["result"]))


def _raw_marker(text: str) -> Callable[[Path, Path], None]:
    """done.json replaced by ``text``, with the marker's own keys spliced in for ``@MARKER@``."""

    def tamper(work: Path, other: Path) -> None:
        path = work / QUANTIZE / MARKER
        marker = json.loads(path.read_text())
        path.write_text(text.replace("@MARKER@", json.dumps(marker)[1:-1]))

    return tamper


def _many_files(marker: dict) -> None:
    marker["files"].update({f"f{i}": {"sha256": "0" * 64, "bytes": 1} for i in range(200_000)})


def _save_metric_is_this_runs(work_of: Callable[[], Path]) -> Callable[[dict], str | None]:
    """The redone save scores the file this run made, not the other run's."""

    def check(report: dict) -> str | None:
        expected = json.loads((work_of() / "06-save" / MARKER).read_text())["result"]["metric"]
        saved = next(s for s in report["stages"] if s["output"] == "06-save/model.safetensors")
        return None if saved["metric"] == expected else f"save's metric {saved['metric']}, not {expected}"

    return check


def _result(**changes) -> Callable[[Path, Path], None]:
    """05-quantize's recorded result with ``changes``."""
    return _edit_marker(QUANTIZE, lambda marker: marker["result"].update(changes))


def _marker(edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    return _edit_marker(QUANTIZE, edit)


def _forge(stage: str) -> Callable[[Path, Path], None]:
    """The other run's model swapped in, and the marker's record of it rewritten to match (size, sha256):
    only the signature can tell."""

    def tamper(work: Path, other: Path) -> None:
        model = work / stage / "model.safetensors"
        shutil.copyfile(other / stage / "model.safetensors", model)
        marker = json.loads((work / stage / MARKER).read_text())
        marker["files"]["model.safetensors"] = {"sha256": file_sha256(model), "bytes": model.stat().st_size}
        marker["result"]["file_bytes"] = model.stat().st_size
        (work / stage / MARKER).write_text(json.dumps(marker))

    return tamper


def _marker_of_another_stage(work: Path, other: Path) -> None:
    shutil.copyfile(work / "06-save" / MARKER, work / QUANTIZE / MARKER)


def _model_record(**changes) -> Callable[[Path, Path], None]:
    return _marker(lambda marker: marker["files"]["model.safetensors"].update(changes))


TAMPERS: list[tuple[str, Callable[[Path, Path], None], str, str]] = [
    ("swap-a-stage-model-from-another-run", _swap(PRUNE, name="model.safetensors"), PRUNE, ""),
    ("swap-a-stage-folder-from-another-run", _swap(PRUNE), PRUNE, ""),
    ("swap-a-marker-from-another-run", _swap("04-recover", name=MARKER), "04-recover", ""),
    ("swap-the-baseline-from-another-run", _swap("01-baseline"), "01-baseline", ""),
    ("swap-every-stage-from-another-run", _swap(*STAGES), "01-baseline", ""),
    ("swap-the-saved-model-from-another-run", _swap("06-save"), "06-save", "save-metric"),
    ("flip-a-byte-of-a-stage-model", _flip(PRUNE), PRUNE, ""),
    ("flip-a-byte-of-the-saved-model", _flip("06-save", at=-8), "06-save", "save-metric"),
    ("truncate-a-stage-model", _truncate("04-recover"), "04-recover", ""),
    ("plant-a-file-in-a-stage", _write("05-quantize", "predict.py", b"print('ran')\n"), "05-quantize", ""),
    ("stage-model-is-a-link", _link_model, PRUNE, ""),
    ("stage-folder-is-a-link", _link_stage, "04-recover", ""),
    ("stage-folder-is-a-file", _file_for_stage, "05-quantize", ""),
    ("marker-not-json", _write(QUANTIZE, MARKER, b"\x00\xff{not json"), QUANTIZE, ""),
    ("marker-empty", _write(QUANTIZE, MARKER, b""), QUANTIZE, ""),
    ("marker-of-an-older-slimtorch", _old_marker, QUANTIZE, ""),
    ("marker-metric-a-string", _result(metric="99.5"), QUANTIZE, ""),
    ("marker-size-a-string", _result(file_bytes="1e9"), QUANTIZE, ""),
    ("marker-without-files", _marker(lambda marker: marker.pop("files")), QUANTIZE, ""),
    ("marker-without-a-metric", _marker(lambda marker: marker["result"].pop("metric")), QUANTIZE, ""),
    ("marker-result-a-list", _marker(lambda marker: marker.update(result=[1, 2])), QUANTIZE, ""),
    ("marker-unknown-result-key", _result(evil=1), QUANTIZE, ""),
    ("marker-200000-files", _marker(_many_files), QUANTIZE, ""),
    ("marker-over-16-mib", _result(reason="x" * (17 << 20)), QUANTIZE, ""),
    ("marker-deep-nesting", _raw_marker('{@MARKER@, "n": ' + "[" * 10**5 + "]" * 10**5 + "}"), QUANTIZE, ""),
    ("marker-nan-metric", _result(metric=math.nan), QUANTIZE, ""),
    ("marker-huge-integer", _raw_marker('{@MARKER@, "n": 1' + "0" * 100 + "}"), QUANTIZE, ""),
    ("marker-is-a-link-to-dev-zero", _marker_link_to_dev_zero, QUANTIZE, ""),
    ("marker-is-a-folder", _marker_folder, QUANTIZE, ""),
    (
        "marker-from-another-version",
        _edit_marker(PRUNE, lambda marker: marker.update(version="0.0.1")),
        PRUNE,
        "",
    ),
    ("marker-with-another-hash", _model_record(sha256="0" * 64), QUANTIZE, ""),
    ("marker-negative-size", _model_record(bytes=-1), QUANTIZE, ""),
    ("marker-of-another-stage", _marker_of_another_stage, QUANTIZE, ""),
    ("marker-output-elsewhere", _result(output="../../etc/passwd"), QUANTIZE, ""),
    ("forge-a-marker-matching-a-swapped-model", _forge(PRUNE), PRUNE, ""),
]


def tamper_cases() -> list[Case]:
    """A finished run copied, tampered with, and resumed: the tampered stage and the later ones redone."""
    cases = []
    for name, tamper, first, more in TAMPERS:

        def build(folder: Path, tamper=tamper, first=first, more=more) -> Invocation:
            root = folder.parent
            mine, other = _reference(root, 0), _reference(root, 1)
            work = folder / "work"
            shutil.copytree(mine, work, symlinks=True)
            tamper(work, other)
            recipe = mine.parent / "recipe-0.toml"
            extra = _save_metric_is_this_runs(lambda: mine) if more == "save-metric" else None
            check = _resume_check(_after(first), extra)
            return Invocation(["slim", "--recipe", str(recipe), "--work", str(work), "--json"], check=check)

        cases.append(Case(f"workfolder/{name}", "workfolder", "accept", build))
    return cases


def _nothing_ran(folder: Path) -> Callable[[str, str], str | None]:
    def check(stdout: str, stderr: str) -> str | None:
        if (folder / "work" / "01-baseline").exists():
            return "a stage ran before the refusal"
        return None

    return check


RECIPES: list[tuple[str, dict]] = [
    ("recover-epochs-a-billion", {"options": {"recover_epochs": "1000000000"}}),
    ("recover-epochs-negative", {"options": {"recover_epochs": "-1"}}),
    ("recover-epochs-a-float", {"options": {"recover_epochs": "1.5"}}),
    ("ratios-negative", {"options": {"ratios": "[-0.5]"}}),
    ("ratios-strings", {"options": {"ratios": '["0.5"]'}}),
    ("ratios-nan", {"options": {"ratios": "[nan]"}}),
    ("lr-nan", {"options": {"lr": "nan"}}),
    ("lr-inf", {"options": {"lr": "inf"}}),
    ("lr-negative", {"options": {"lr": "-0.1"}}),
    ("max-drop-inf", {"options": {"max_drop": "inf"}}),
    ("max-drop-a-bool", {"options": {"max_drop": "true"}}),
    ("batch-a-trillion", {"options": {"batch": "1000000000000"}}),
    ("seed-negative", {"options": {"seed": "-1"}}),
    ("attempts-a-billion", {"options": {"attempts": "1000000000"}}),
    ("export-a-string", {"options": {"export": '"yes"'}}),
    ("goal-a-number", {"options": {"goal": "5"}}),
    ("probe-one", {"options": {"probe": "1.0"}}),
    ("option-unknown", {"options": {"epochs": "3"}}),
    ("option-a-table", {"options": {"ratios": "{ a = 1 }"}}),
    ("inputs-unknown", {"inputs": {"evil": '"x"'}}),
    ("inputs-data-a-number", {"inputs": {"data": "5"}}),
    ("inputs-without-data", {"inputs": {"data": None}}),
    ("plan-unknown", {"plan": {"extra": "1"}}),
    ("plan-ratios-strings", {"plan": {"ratios": '["x"]'}}),
    ("plan-chosen-a-string", {"plan": {"chosen": '"a"'}}),
    ("plan-chosen-out-of-range", {"plan": {"chosen": "99"}}),
    ("plan-lengths-differ", {"plan": {"schemes": '["int8-weight", "int4-weight"]'}}),
    ("plan-scheme-unknown", {"plan": {"schemes": '["int2"]'}}),
]


def recipe_cases() -> list[Case]:
    """Recipes out of bounds: refused in one line naming the file and the field, before any stage runs."""
    cases = []
    for name, changes in RECIPES:

        def build(folder: Path, changes=changes) -> Invocation:
            (folder / "tiny.py").write_text(TINY)
            recipe = folder / "recipe.toml"
            recipe.write_text(_recipe_text(str(folder / "tiny.py"), **changes))
            argv = ["slim", "--recipe", str(recipe), "--work", str(folder / "work")]
            return Invocation(argv, check=_nothing_ran(folder))

        cases.append(Case(f"workfolder/recipe-{name}", "workfolder", "refuse", build))

    def raw(name: str, write: Callable[[Path], object]) -> Case:
        def build(folder: Path) -> Invocation:
            recipe = folder / "recipe.toml"
            write(recipe)
            argv = ["slim", "--recipe", str(recipe), "--work", str(folder / "work")]
            return Invocation(argv, check=_nothing_ran(folder))

        return Case(f"workfolder/recipe-{name}", "workfolder", "refuse", build)

    cases += [
        raw("not-toml", lambda p: p.write_bytes(b"\x00\xff[options\n")),
        raw("a-link-to-dev-zero", lambda p: p.symlink_to("/dev/zero")),
        raw("deep-nesting", lambda p: p.write_text("a = " + "[" * 50_000 + "]" * 50_000 + "\n")),
        raw("options-not-a-table", lambda p: p.write_text("options = 5\n")),
        raw("over-16-mib", lambda p: p.write_text("#" + "x" * (17 << 20) + "\n")),
    ]
    return cases


def work_recipe_cases() -> list[Case]:
    """The work folder's own recipe.toml tampered with: refused, naming it, before any stage runs."""
    cases = []
    for name, line, tampered in (
        ("recover-epochs-a-billion", "recover_epochs = 1\n", "recover_epochs = 1000000000\n"),
        ("plan-chosen-a-string", "chosen = 0\n", 'chosen = "a"\n'),  # the plan is no part of the identity
    ):

        def build(folder: Path, line=line, tampered=tampered) -> Invocation:
            mine = _reference(folder.parent, 0)
            work = folder / "work"
            shutil.copytree(mine, work, symlinks=True)
            recipe = work / "recipe.toml"
            assert line in recipe.read_text()
            recipe.write_text(recipe.read_text().replace(line, tampered))
            argv = ["slim", "--recipe", str(mine.parent / "recipe-0.toml"), "--work", str(work), "--json"]

            def check(stdout: str, stderr: str) -> str | None:
                return "a stage was reported" if _report(stdout) else None

            return Invocation(argv, check=check)

        cases.append(Case(f"workfolder/work-recipe-{name}", "workfolder", "refuse", build))
    return cases


def option_cases() -> list[Case]:
    """The same bounds on the command line: one line naming the option, before any stage runs."""
    cases = []
    for name, words in (
        ("epochs-a-billion", ["--epochs", "1000000000"]),
        ("max-drop-nan", ["--max-drop", "nan"]),
        ("lr-inf", ["--lr", "inf"]),
    ):

        def build(folder: Path, words=words) -> Invocation:
            (folder / "tiny.py").write_text(TINY)
            argv = ["slim", f"{folder / 'tiny.py'}:Tiny", "--data", "digits", "--goal", "params=0.6"]
            argv += [*words, "--work", str(folder / "work")]
            return Invocation(argv, check=_nothing_ran(folder), names_file=False)

        cases.append(Case(f"workfolder/option-{name}", "workfolder", "refuse", build))
    return cases


def corpus() -> list[Case]:
    return cases_of(tamper_cases(), recipe_cases(), work_recipe_cases(), option_cases())


def _fresh_run(folder: Path) -> Invocation:
    """A clean ``slim`` run of the tiny model into an empty work folder: the command's own start, which
    the strict cases' peaks are held to (training and quantizing it take about 50 MiB over the imports)."""
    (folder / "tiny.py").write_text(TINY)
    recipe = folder / "recipe.toml"
    recipe.write_text(_recipe_text(str(folder / "tiny.py"), options={"seed": "0"}))
    return Invocation(["slim", "--recipe", str(recipe), "--work", str(folder / "work"), "--json"])


CASES = strict(corpus(), start=_fresh_run)
