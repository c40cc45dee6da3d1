"""Writing a plan: each tensor encoded by its policy (:mod:`slimtorch.format.policy`) into a
:class:`~slimtorch.format.writer.SlimWriter`, in the ``hf`` layout the compressed-tensors form of quantized
weights, then the report of what was stored."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from slimtorch.format.codecs import REGISTRY, Encoded, decode
from slimtorch.format.codecs.chain import parse_dtype
from slimtorch.format.codecs.lossy import ErrorStats, decoded_blocks
from slimtorch.format.hf_layout import (
    CtScheme,
    ct_form,
    folder_config,
    quantization_config,
    weight_names,
    write_config,
)
from slimtorch.format.policy import (
    QUANTIZE_MIN_ELEMENTS,
    TensorPolicy,
    convert,
    encode_tensor,
    finish_coded,
    quantizable,
)
from slimtorch.format.progress import Progress, task
from slimtorch.format.source import dtype_name
from slimtorch.format.units import format_bytes
from slimtorch.format.writer import SlimWriter
from slimtorch.inspection.breakdown import Bucket
from slimtorch.shrinking.folders import Folder
from slimtorch.shrinking.planning import Item, Plan
from slimtorch.shrinking.report import ShrinkReport, TensorResult
from slimtorch.sources.companions import model_card


def write(
    plan: Plan,
    out: str | os.PathLike[str],
    policy: TensorPolicy,
    shard_bytes: int | None,
    provenance: dict[str, Any],
    companions: Mapping[str, Path | bytes],
    progress: Progress | None,
    delta: dict[str, Any] | None = None,
    *,
    folder: Folder | None = None,
) -> tuple[list[TensorResult], list[Path], int]:
    """Write the plan's tensors and the folder's files; a folder with a ``config.json`` gets one written
    for its layout (``hf``: with the ``quantization_config`` of what was written quantized)."""
    folder = folder or Folder()
    hf = folder.layout == "hf"
    if hf:
        _every_name_stored(plan)
    with tempfile.TemporaryDirectory() as staging:
        if folder.config is not None:  # written once the quantized layers are known; named from the start
            companions = {**companions, "config.json": Path(staging) / "config.json"}
        writer = SlimWriter(
            out,
            shard_bytes=shard_bytes,
            ties=plan.ties,
            copies=plan.copies,
            provenance=provenance,
            delta=delta,
            extra_files=companions,
            objects=plan.objects.values,
            card=lambda card, written: model_card(card, provenance, delta, written),
            expected_tensors=len(plan.items),
        )
        try:
            with task(progress, "shrinking", sum(item.before_bytes for item in plan.items)) as advance:
                results, schemes = _add_all(writer, plan, policy, advance, folder)
            if folder.config is not None:
                quantization = quantization_config(schemes, folder.base_prefix) if hf else None
                write_config(
                    Path(staging), folder_config(folder.config, folder.layout, quantization, policy.dtype)
                )
            files = writer.commit()
        except BaseException:
            writer.abort()
            raise
    return results, files, sum(f.stat().st_size for f in files if f.suffix == ".safetensors")


def _add_all(
    writer: SlimWriter, plan: Plan, policy: TensorPolicy, advance: Callable[[int], None], folder: Folder
) -> tuple[list[TensorResult], dict[str, CtScheme]]:
    """Queue every tensor of the plan; returns what was stored and, in the ``hf`` layout, the
    compressed-tensors scheme of each weight written in that form."""
    hf = folder.layout == "hf"
    results: list[TensorResult] = []
    schemes: dict[str, CtScheme] = {}
    bits = _ct_bits(plan, policy) if hf else None
    for item in (i for i in plan.items if i.encoded is not None):
        encoded = finish_coded(item.encoded, policy)  # type: ignore[arg-type]
        stage = encoded.stages[0]
        dtype, shape = parse_dtype(stage["dtype"]), tuple(stage["shape"])
        entry = _add(writer, item.name, encoded, dtype, shape, bits, schemes, folder.dynamic)
        results.append(
            TensorResult(
                item.name, item.category, entry.chain, stage["dtype"], item.before_bytes, encoded.nbytes
            )
        )
    floated = []
    for item, original in _fetched([i for i in plan.items if i.encoded is None]):
        value = convert(item.name, original.detach().cpu(), policy)
        measured = ErrorStats()
        encoded = encode_tensor(item.name, value, item.category, policy, measured)
        _add(writer, item.name, encoded, value.dtype, tuple(value.shape), bits, schemes, frozenset())
        if hf and policy.quantize and _float_in_hf(item, value, encoded, policy):
            floated.append(item.name)
        results.append(_result(item, original, value, encoded, measured))
        advance(item.before_bytes)
    if floated:
        folder.notes.append(_floated_note(floated))
    return results, schemes


def _add(
    writer: SlimWriter,
    name: str,
    encoded: Encoded,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    bits: int | None,
    schemes: dict[str, CtScheme],
    dynamic: frozenset[str],
) -> Any:
    """Queue one tensor: in the ``hf`` layout (``bits``: the folder's one compressed-tensors width) a
    quantized one goes in the compressed-tensors form (its scheme noted for ``quantization_config``), and
    anything else transformers cannot read dense."""
    hf = bits is not None
    quantized = bool(encoded.stages) and encoded.stages[0].get("codec") in ("int8", "int4")
    if hf and quantized:
        found = ct_form(name, encoded)
        if found is not None and found[2].bits == bits:
            coded, keys, scheme = found
            schemes[name] = replace(scheme, activations=name in dynamic)
            return writer.add(name, coded, dtype, shape, keys)
    if hf and encoded.stages and encoded.stages[0].get("codec") != "cast":
        # sparse, zstd, a code form compressed-tensors lacks: the values the slim loader would give
        encoded = Encoded({"": decode(encoded.parts, encoded.stages, dtype, shape)}, [])
    return writer.add(name, encoded, dtype, shape)


def _ct_bits(plan: Plan, policy: TensorPolicy) -> int:
    """The one width a folder's compressed-tensors weights have: transformers decodes a folder mixing
    int4 (``pack-quantized``) and int8 groups with the wrong decoder, so int4 when anything is int4."""
    coded = (
        i.encoded.stages[0].get("codec") for i in plan.items if i.encoded is not None and i.encoded.stages
    )
    return 4 if policy.codec == "int4" or "int4" in set(coded) else 8


def _every_name_stored(plan: Plan) -> None:
    """Turn ties and copies into tensors of their own (transformers knows neither): each name stored."""
    by_name = {item.name: item for item in plan.items}
    for name, target in {**plan.ties, **plan.copies}.items():
        original = by_name[target]
        plan.items.append(replace(original, name=name, before_bytes=0))
    plan.ties, plan.copies = {}, {}


def _float_in_hf(item: Item, value: torch.Tensor, encoded: Encoded, policy: TensorPolicy) -> bool:
    """Whether a weight the slim layout would quantize stays float because compressed-tensors cannot
    hold it (a convolution, GPT-2's Conv1D, int4 groups that do not fit its rows)."""
    slim = replace(policy, layout="slim")
    return not encoded.stages and quantizable(item.name, value, item.category, slim)


def _floated_note(names: list[str]) -> str:
    return (
        f"{len(names)} weight(s) kept at their precision in the hf layout "
        f"({', '.join(weight_names(names))}): compressed-tensors quantizes nn.Linear and nn.Embedding "
        "weights only, int4 in whole groups per row; --layout slim quantizes them"
    )


def _result(
    item: Item, original: torch.Tensor, value: torch.Tensor, encoded: Encoded, measured: ErrorStats
) -> TensorResult:
    """What was stored; the error as the int8 codec ``measured`` it while encoding, else compared now."""
    converted = value.dtype != original.dtype
    lossy = converted or any(
        not REGISTRY[s["codec"]].lossless for s in encoded.stages if s["codec"] in REGISTRY
    )
    error = None
    if lossy:
        error = measured.result if measured.blocks and not converted else _error(original, encoded, value)
    return TensorResult(
        item.name,
        item.category,
        f"{dtype_name(value.dtype)} {encoded.chain}" if converted else encoded.chain,
        dtype_name(value.dtype),
        item.before_bytes,
        encoded.nbytes,
        *(error or (None, None)),
    )


def _fetched(items: list[Item]) -> Iterator[tuple[Item, torch.Tensor]]:
    for item in items:
        yield item, item.fetch()


def _error(original: torch.Tensor, encoded: Any, value: torch.Tensor) -> tuple[float, float] | None:
    """Max abs and relative L2 error of the stored tensor against the original (floats only), compared a
    block of rows at a time: a decoded copy of a whole 2 GB embedding would outweigh the rest of a shrink."""
    if not original.dtype.is_floating_point or original.numel() == 0:
        return None
    reference_rows = original.reshape(original.shape[0], -1) if original.dim() >= 2 else None
    stats = ErrorStats()
    for block, decoded in decoded_blocks(encoded.parts, encoded.stages, value.dtype, tuple(value.shape)):
        part = original if reference_rows is None else reference_rows[block]
        reference = part.reshape(decoded.shape[0], -1).to(torch.float32)
        stats.add(decoded.reshape(reference.shape).to(torch.float32, copy=True), reference)
    return stats.result


def report_of(
    source: str,
    before_bytes: int,
    before: list[Bucket],
    plan: Plan,
    results: list[TensorResult],
    files: list[Path],
    written: int,
    started: float,
    folder: Folder | None = None,
) -> ShrinkReport:
    """The report of a written plan: bytes after by category, the format's own bytes as
    ``format_overhead``, and the notes a user should read (a removed wrapper prefix, the folder's)."""
    after: dict[str, list[int]] = {}
    for result in results:
        bucket = after.setdefault(result.category, [0, 0])
        bucket[0] += 1
        bucket[1] += result.after_bytes
    overhead = written - sum(r.after_bytes for r in results)
    buckets = [Bucket(name, n, b) for name, (n, b) in after.items()]
    buckets.append(Bucket("format_overhead", 0, overhead))
    notes = []
    if plan.renamed_prefix:
        notes.append(
            f"names lost the training wrapper prefix {plan.renamed_prefix!r} (keep it with --keep-names)"
        )
    notes += folder.notes if folder else []
    if source != "<state_dict>" and 0 < before_bytes < written:  # a save has no file to compare with
        small = all(r.before_bytes < QUANTIZE_MIN_ELEMENTS * parse_dtype(r.dtype).itemsize for r in results)
        notes.append(
            f"the output is {format_bytes(written)}, more than the source's {format_bytes(before_bytes)}: "
            f"the format's own {format_bytes(overhead)} (a checksum and a record per tensor, the provenance) "
            "outweigh what this file could save"
            + (f"; no tensor has the {QUANTIZE_MIN_ELEMENTS:,} elements a codec quantizes" if small else "")
        )
    return ShrinkReport(
        source=source,
        files=[str(f) for f in files],
        before_bytes=before_bytes,
        after_bytes=written,
        before=before,
        after=buckets,
        tensors=results,
        dropped=plan.dropped,
        folded=plan.folded,
        ties=plan.ties,
        copies=plan.copies,
        renamed_prefix=plan.renamed_prefix,
        seconds=time.perf_counter() - started,
        notes=notes,
        objects=list(plan.objects.values),
        dropped_objects=plan.objects.dropped,
        stored_instead=plan.stored_instead,
    )
