""":func:`slim`: from a model and a goal to a smaller, verified deliverable, one stage at a time.

baseline (measure, plan) -> per attempt: prune -> sparsify -> recover -> quantize -> save (loaded back and
scored) -> export (optional). Each stage keeps its output and a done marker in the work folder, so a rerun
resumes once the marker checks out (:mod:`slimtorch.slimming.markers`); an attempt whose metric drops
more than ``max_drop`` is followed by the next, less aggressive plan, and the best result within the drop
is kept either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.progress import Progress, task
from slimtorch.format.verbs import resolve
from slimtorch.recovery.data import TaskData, open_data
from slimtorch.slimming import stages
from slimtorch.slimming.attempts import ATTEMPT_STAGES, Attempt, StageRun, fares
from slimtorch.slimming.baseline import baseline
from slimtorch.slimming.context import Context, model_digest, timed
from slimtorch.slimming.finishing import finish
from slimtorch.slimming.goal import parse_goal
from slimtorch.slimming.markers import Inputs, digest, seal
from slimtorch.slimming.options import SlimOptions
from slimtorch.slimming.planning import Candidate
from slimtorch.slimming.recipe import Recipe, check_plan, write_recipe
from slimtorch.slimming.report import SlimReport, stage_entry
from slimtorch.slimming.schema import Invalid
from slimtorch.slimming.workdir import RECIPE, WorkFolder


def slim(
    model: nn.Module | str,
    data: TaskData | str,
    /,
    options: SlimOptions | None = None,
    *,
    work: str | os.PathLike[str] = "slim-work",
    weights: str | os.PathLike[str] | None = None,
    plan: Mapping[str, Any] | None = None,
    restart: bool = False,
    command: str | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> SlimReport:
    """Make ``model`` reach ``goal`` losing at most ``max_drop`` of the data's metric; returns the report,
    whose ``result`` is the deliverable loaded back from its file, and writes ``report.json``,
    ``report.html`` and charts in the work folder.

    Args:
        model: a module, or a model spec as the CLI takes (``pkg.mod:factory``, ``file.py:Class``, a Hugging
            Face folder) with ``weights`` to load into it.
        data: a :class:`~slimtorch.recovery.TaskData` or a data spec (``digits``, a folder, a factory).
        options: :class:`SlimOptions`; ``overrides`` replace its fields (``goal="size=0.05x"``,
            ``max_drop=1``).
        work: the work folder: each stage's output and done marker, ``recipe.toml``, the report. A rerun
            with the same recipe resumes there; another recipe is refused unless ``restart``.
        plan: a recipe's ``[plan]`` table: run its plan instead of planning again.
        command: the command line to record in the report (None: the Python call).

    Example:
        >>> report = slimtorch.slim(model, "digits", goal="size=0.05x", max_drop=1)  # doctest: +SKIP
        >>> report.met, report.reason  # doctest: +SKIP
        (True, 'reached 0.043x the original file ...')
    """
    options = resolve(SlimOptions, options, overrides, "slim")
    if not options.goal:
        raise OptionError("slim needs a goal: size=50MB, size=0.05x, latency=2x or params=0.5")
    goal = parse_goal(options.goal)
    text = data.metric == "perplexity" if isinstance(data, TaskData) else str(data).lower().endswith(".txt")
    if text:  # every stage compares scores as higher-is-better
        raise SlimtorchError(
            f"data {getattr(data, 'spec', data)!r}: slim does not steer by a language model's perplexity "
            "yet; prune it with slimtorch prune --method wanda --data TEXT, quantize with --awq --data TEXT"
        )
    torch.manual_seed(options.seed)
    original, spec, hf_folder, untrained = _model(model, weights)
    task_data = (
        data if isinstance(data, TaskData) else open_data(data, batch=options.batch, seed=options.seed)
    )
    tensors = model_digest(original)
    inputs = {
        "model": spec,
        "weights": str(weights or ""),
        "data": task_data.spec,
        "fingerprint": tensors[:16],
    }
    folder = WorkFolder.claim(work, Recipe(inputs, options), restart=restart)
    context = Context(original, task_data, options, goal, folder, hf_folder, progress, spec)
    if untrained:
        context.notes.append(untrained)
    context.recipe_hash = digest({"recipe": Recipe(inputs, options).identity(), "tensors": tensors})
    forced = _forced(plan) if plan else None  # an empty [plan]: plan again
    step = {"forced": None if forced is None else [c.to_dict() for c in forced]}
    first = _run(context, "01-baseline", "baseline", step, "", lambda where: baseline(context, where, forced))
    candidates = [Candidate.from_dict(c) for c in first.result["plan"]["attempts"]]
    attempts = _attempts(context, first, candidates)
    report, chosen = finish(context, first, attempts, command or _call(spec, options), _export_stage(context))
    write_recipe(Recipe(inputs, options, _plan_table(candidates, chosen, report)), folder.root / RECIPE)
    return report


def _model(model: nn.Module | str, weights: Any) -> tuple[nn.Module, str, Path | None, str]:
    """The original module, the spec to record (empty for a module passed in), its HF folder, and a note
    when a spec's factory was given no weights (its own initial values, random unless it loads some: every
    score of the run is of those)."""
    if isinstance(model, nn.Module):
        if weights is not None:
            raise OptionError("weights is for a model spec; load them into the module yourself")
        return model.eval(), "", None, ""
    if not isinstance(model, (str, os.PathLike)):
        raise OptionError(f"model must be an nn.Module or a model spec, not {type(model).__name__}")
    from slimtorch.loading import open_model

    opened = open_model(model, weights, check_example=False)
    untrained = ""
    if opened.weights is None:
        untrained = (
            f"{model} was given no weights (--weights): it keeps what its factory gives (random initial "
            "values, unless the factory loads weights itself), and every score and verdict here is of those"
        )
    return opened.model.eval(), str(model), opened.folder, untrained


def _run(
    context: Context,
    folder_name: str,
    name: str,
    step: dict[str, Any],
    after: str,
    work: Callable[[Path], tuple[dict[str, Any], nn.Module]],
) -> StageRun:
    """Run a stage, unless its done marker checks out: made from this run's inputs (``step``: what the plan
    asks of it; ``after``: the folder of the stage it starts from), its files as it wrote them. Then its
    recorded result, ``resumed``; a marker that does not check out is redone, with a note saying why."""
    inputs = Inputs(
        context.recipe_hash,
        digest({"stage": folder_name, "name": name, **step}),
        context.seals[after] if after else "",
    )
    marker, why = context.work.verified(folder_name, name, inputs, after)
    latency = name == "save" and context.goal.kind == "latency"
    if marker is not None and latency and "latency" not in marker["result"]:
        marker, why = None, "done.json records no latency, which a latency goal is judged by"
    if marker is not None:
        done = marker["result"]
        context.seals[folder_name] = seal(marker)
        return StageRun(stage_entry(name, "resumed", done, done["seconds"]), done, folder_name)
    if why:
        context.notes.append(f"{folder_name}: redone: {why}")
    with task(context.progress, f"slim: {name}"):
        (result, model), seconds = timed(lambda: work(context.work.redo(folder_name)))
    result["seconds"] = seconds
    context.models[folder_name] = model
    context.seals[folder_name] = context.work.finish(folder_name, name, inputs, result)
    return StageRun(stage_entry(name, "done", result, seconds), result, folder_name)


def _attempts(context: Context, first: StageRun, candidates: list[Candidate]) -> list[Attempt]:
    """The plan's candidates tried in order, at most ``attempts`` of them, until one reaches the goal within
    the drop. A pruning that lost too much is not tried again with fewer bits; a result within the drop
    that does not reach the goal (the back-off) ends the run: what follows it is further from the goal."""
    attempts: list[Attempt] = []
    failed: set[tuple[float, float]] = set()
    for candidate in candidates:
        if len(attempts) == context.options.attempts:
            break
        if (candidate.ratio, candidate.sparsity) in failed:
            continue
        attempts.append(_attempt(context, candidate, len(attempts), first.result["params"]))
        _, within = fares(context, first.result, attempts[-1])
        if within:
            break
        failed.add((candidate.ratio, candidate.sparsity))
    return attempts


def _attempt(context: Context, candidate: Candidate, index: int, params: int | None) -> Attempt:
    """The stages of one plan, each from the model the previous one left (``params``: the baseline's; a
    skipped stage shows those of the stage before it)."""
    attempt, previous = Attempt(candidate), "01-baseline"
    tag = f"attempt {index + 1}, {candidate.label}: "
    for offset, name in enumerate(ATTEMPT_STAGES):
        why = _skip(name, candidate, context.options)
        if why is not None:
            entry = stage_entry(name, "skipped", {"reason": tag + why, "params": params}, 0.0)
            attempt.runs.append(StageRun(entry, {}, None))
            continue
        folder_name = f"{2 + index * len(ATTEMPT_STAGES) + offset:02d}-{name}"
        work = _on_model_of(context, previous, _step(name), candidate)
        run = _run(context, folder_name, name, {"candidate": candidate.to_dict()}, previous, work)
        run.entry["reason"] = tag + run.entry["reason"]
        attempt.runs.append(run)
        previous, params = folder_name, run.result.get("params")
    return attempt


def _skip(name: str, candidate: Candidate, options: SlimOptions) -> str | None:
    """Why the plan skips stage ``name`` (None: it runs)."""
    pruned = bool(candidate.ratio or candidate.sparsity)
    if name == "prune" and not candidate.ratio:
        return "the plan removes no channels"
    if name == "sparsify" and not candidate.sparsity:
        return "the plan zeroes no weights"
    if name == "recover":
        if not pruned:
            return "nothing was pruned, so nothing to win back"
        if "recover" not in options.stages or options.recover_epochs == 0:
            return "recovery is not allowed by the options (stages, recover_epochs)"
    if name == "quantize" and not candidate.scheme:
        return "the plan keeps float weights"
    return None


WITH_CANDIDATE = ("prune", "sparsify", "quantize")


def _on_model_of(
    context: Context, source: str, step: Callable[..., tuple[dict[str, Any], nn.Module]], candidate: Candidate
) -> Callable[[Path], tuple[dict[str, Any], nn.Module]]:
    """``step`` as a stage's work in the folder it is given, on the model of folder ``source`` (loaded only
    when the stage runs, not when it resumes)."""
    return lambda where: step(context, where, context.model_of(source), candidate)


def _step(name: str) -> Callable[..., tuple[dict[str, Any], nn.Module]]:
    """Stage ``name``'s function as ``(context, folder, model, candidate)``, looked up when it runs."""
    run = getattr(stages, name)
    if name in WITH_CANDIDATE:
        return run
    return lambda context, where, model, candidate: run(context, where, model)


def _export_stage(context: Context) -> Callable[[str], StageRun] | None:
    """The export stage, run on the deliverable's folder, when ``export`` is on."""
    if not context.options.export:
        return None

    def run(source: str) -> StageRun:
        return _run(
            context,
            "90-export",
            "export",
            {},
            source,
            lambda where: stages.export(context, where, context.model_of(source)),
        )

    return run


def _forced(plan: Mapping[str, Any]) -> list[Candidate]:
    """The candidates a recipe's plan table names (its ``chosen`` one alone, when it has one)."""
    try:
        check_plan(plan)
    except Invalid as error:
        raise OptionError(str(error)) from None
    ratios, sparsities, schemes = (list(plan.get(k, [])) for k in ("ratios", "sparsities", "schemes"))
    candidates = [
        Candidate(float(r), float(z), s or None) for r, z, s in zip(ratios, sparsities, schemes, strict=True)
    ]
    chosen = int(plan.get("chosen", -1))
    return [candidates[chosen]] if 0 <= chosen < len(candidates) else candidates


def _plan_table(candidates: list[Candidate], chosen: int | None, report: SlimReport) -> dict[str, Any]:
    """The recipe's ``[plan]``: every attempt's choices, which one was kept, and what quantize kept float."""
    return {
        "ratios": [c.ratio for c in candidates],
        "sparsities": [c.sparsity for c in candidates],
        "schemes": [c.scheme or "" for c in candidates],
        "chosen": -1 if chosen is None else int(chosen),
        "kept_float": [row["name"] for row in report.layers if str(row["quantized"]).startswith("kept")],
    }


def _call(spec: str, options: SlimOptions) -> str:
    return f"slimtorch.slim({spec or 'model'!r}, ..., goal={options.goal!r}, max_drop={options.max_drop})"
