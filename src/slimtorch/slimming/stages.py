"""The stages of a ``slimtorch slim`` run, each a function ``(context, folder, model) -> (result, model)``
that saves its model in its folder and measures it; :mod:`slimtorch.slimming.pipeline` chains them, skips
the finished ones and writes their done markers."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.format.units import format_bytes
from slimtorch.loading import load_model
from slimtorch.prune import channels
from slimtorch.prune import weights as zero_weights
from slimtorch.quant import quantize as quantize_model
from slimtorch.recovery import recover as recover_model
from slimtorch.shrinking import save_model
from slimtorch.slimming.context import MODEL_FILE, Context, TeacherTargets, cosine_loss
from slimtorch.slimming.measuring import latency_pair, saved_facts
from slimtorch.slimming.planning import Candidate

Result = dict[str, Any]


def saved(context: Context, folder: Path, model: nn.Module, reason: str) -> Result:
    """Save ``model`` as the stage's file and measure it: the common part of every stage's result."""
    path = folder / MODEL_FILE
    save_model(model, path)
    facts = saved_facts(path, context.kinds)
    return {"reason": reason, "metric": context.score(model), "output": context.work.relative(path), **facts}


def prune(context: Context, folder: Path, model: nn.Module, candidate: Candidate) -> tuple[Result, nn.Module]:
    """Remove ``candidate.ratio`` of the channels of every prunable group (``slimtorch.prune.channels``)."""
    model = copy.deepcopy(model)
    report = channels(model, context.data.example, ratio=candidate.ratio, progress=context.progress)
    whole = "; ".join(f"{count} group(s) kept whole: {why}" for why, count in report.frozen.items())
    reason = (
        f"removed {candidate.ratio:.0%} of the channels of {report.pruned_groups} of {report.groups} groups "
        f"({report.params_before:,} -> {report.params_after:,} params)" + (f"; {whole}" if whole else "")
    )
    return saved(context, folder, model, reason), model


def sparsify(
    context: Context, folder: Path, model: nn.Module, candidate: Candidate
) -> tuple[Result, nn.Module]:
    """Zero ``candidate.sparsity`` of the weights, smallest magnitudes first (``slimtorch.prune.weights``)."""
    model = copy.deepcopy(model)
    report = zero_weights(model, candidate.sparsity)
    result = saved(context, folder, model, f"zeroed the smallest weights, global magnitude: {report.summary}")
    return {**result, "zeros": report.layers}, model


def recover(context: Context, folder: Path, model: nn.Module) -> tuple[Result, nn.Module]:
    """Distil the pruned model from the original (``slimtorch.recover``): the original's softened logits
    for accuracy, its outputs' cosine for a cosine task (no labels there)."""
    options = context.options
    model = copy.deepcopy(model)
    torch.manual_seed(options.seed)
    if context.data.metric == "cosine":
        train: Any = TeacherTargets(context.data, context.original)
        report = recover_model(
            model,
            train,
            epochs=options.recover_epochs,
            lr=options.lr,
            loss_fn=cosine_loss,
            progress=context.progress,
        )
        how = "trained toward the original's outputs (cosine loss)"
    else:
        report = recover_model(
            model,
            context.data.train,
            epochs=options.recover_epochs,
            lr=options.lr,
            teacher=context.original,
            progress=context.progress,
        )
        how = "distilled from the original (KL of softened logits, alpha 0.9)"
    reason = f"{how}, {options.recover_epochs} epochs, {report.steps} steps, lr {options.lr:g}"
    return saved(context, folder, model, reason), model


def quantize(
    context: Context, folder: Path, model: nn.Module, candidate: Candidate
) -> tuple[Result, nn.Module]:
    """Quantize with ``candidate.scheme``; the layers whose error would dominate stay float, named."""
    model = copy.deepcopy(model)
    report = quantize_model(
        model,
        candidate.scheme,
        calibration=context.calibration(),
        integer_zero=context.folder is not None,  # int4 as compressed-tensors holds it, for the HF folder
        progress=context.progress,
    )
    short = candidate.scheme.removesuffix("-weight").removesuffix("-dynamic")  # type: ignore[union-attr]
    quantized = {layer.name: short for layer in report.layers}
    kept = {name: why for name, why in report.skipped.items()}
    reason = f"{candidate.scheme}: {len(quantized)} layers quantized" + (
        f", {len(kept)} kept float ({'; '.join(f'{n}: {w}' for n, w in kept.items())})" if kept else ""
    )
    result = saved(context, folder, model, reason)
    return {**result, "quantized": quantized, "kept": kept}, model


def save(context: Context, folder: Path, model: nn.Module) -> tuple[Result, nn.Module]:
    """Save the deliverable and verify it: loaded back from its file, scored, and (latency goals) timed
    against the original."""
    path = folder / MODEL_FILE
    save_model(model, path)
    loaded = load_model(path, context.factory).model
    assert loaded is not None  # load_model's report holds the model it filled
    facts = saved_facts(path, context.kinds)
    result = {"metric": context.score(loaded), "output": context.work.relative(path), **facts}
    if context.goal.kind == "latency":
        result["latency"] = latency_pair(context.original, loaded, context.data.example)
    result["reason"] = f"saved {format_bytes(facts['file_bytes'])}, loaded back and scored from the file"
    if context.folder is not None:
        result["reason"] += _hugging_face_folder(context, folder, model, result)
    return result, loaded


def _hugging_face_folder(context: Context, folder: Path, model: nn.Module, result: Result) -> str:
    """A model from a Hugging Face folder is also saved as one (``hf/``: config.json with the new sizes,
    the weights as ``from_pretrained`` reads them); the clause that says so, or why not."""
    if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
        return (
            "; no Hugging Face folder: the model is not a transformers model (load the file with load_model)"
        )
    save_model(model, folder / "hf", layout="hf")
    result["hf_folder"] = context.work.relative(folder / "hf")
    return f"; and as a Hugging Face folder, {result['hf_folder']}"


def export(context: Context, folder: Path, model: nn.Module) -> tuple[Result, nn.Module]:
    """Export an ONNX bundle of the deliverable, verified against eager PyTorch, and measure the
    footprint of its runtime (``slimtorch.deploy``)."""
    from slimtorch.deploy import export as export_bundle
    from slimtorch.deploy.footprint import baseline_cache_path, footprint

    bundle = folder / "bundle"
    export_bundle(model, (context.data.example[:1],), bundle)
    cached = baseline_cache_path().exists()  # measuring torch's own footprint installs torch: ~860 MB
    measured = footprint(bundle, baseline=cached)
    torch_bytes = measured.baseline.runtime_bytes if measured.baseline else None
    beside = (
        ""
        if cached
        else "; torch's footprint not measured (no cached baseline: `slimtorch footprint` makes it)"
    )
    result = {
        "reason": f"ONNX bundle, checked; runtime {format_bytes(measured.runtime_bytes)}{beside}",
        "metric": None,
        "output": context.work.relative(bundle),
        "footprint": {
            "command": f"slimtorch footprint {bundle}",
            "bundle_bytes": sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()),
            "runtime": "onnxruntime",
            "runtime_bytes": measured.runtime_bytes,
            "torch_bytes": torch_bytes,
        },
    }
    return result, model
