"""What shrink and the save verbs did: :class:`ShrinkReport`, whose ``to_dict()`` is the ``--json`` output."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from slimtorch.format.sensitive import StoredInstead
from slimtorch.format.verbs import Report
from slimtorch.inspection.breakdown import BUCKETS_SCHEMA, Bucket, by_name
from slimtorch.prune.hf import ConfigUpdate


@dataclass(frozen=True)
class TensorResult:
    """One stored tensor: its codec chain, bytes before and after, and the error of lossy codecs."""

    name: str
    category: str
    chain: str
    dtype: str
    before_bytes: int
    after_bytes: int
    max_abs: float | None = None
    rel_l2: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShrinkReport(Report):
    """What :func:`~slimtorch.shrinking.saving.shrink` or a save verb stored, and what it cost.

    ``before`` and ``after`` are bytes by category (the JSON has them by name: ``{"parameters": {"tensors":
    3, "bytes": 1024}}``); ``ratio`` is ``after_bytes / before_bytes``.
    """

    SCHEMA: ClassVar[str] = "slimtorch.shrink/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {"ratio": {"type": "number"}}
    _BY_NAME: ClassVar[tuple[str, ...]] = ("before", "after")

    source: str
    files: list[str]
    before_bytes: int
    after_bytes: int
    before: list[Bucket]
    after: list[Bucket]
    tensors: list[TensorResult]
    dropped: list[str]
    folded: list[str]
    ties: dict[str, str]
    copies: dict[str, str]
    renamed_prefix: str | None
    seconds: float
    notes: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    """Top-level names of the non-tensor values kept (read them with :func:`slimtorch.load_objects`)."""
    dropped_objects: dict[str, str] = field(default_factory=dict)
    """Non-tensor values left out because they are not plain data, with the reason."""
    stored_instead: list[StoredInstead] = field(default_factory=list)
    """Weights stored at a higher precision than asked (float16 or int8), and why; none with
    ``quantize_all``."""
    config_update: ConfigUpdate | None = None
    """:func:`~slimtorch.shrinking.pretrained.save_pretrained`: the pruned sizes written into
    ``config.json``, and the sizes no config can express (None from the other verbs)."""

    @property
    def ratio(self) -> float:
        return self.after_bytes / self.before_bytes if self.before_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The fields, ``ratio``, then the buckets by name and the tensors (the order the JSON always had)."""
        values = super().to_dict()
        ordered = {k: v for k, v in values.items() if k not in (*self._BY_NAME, "tensors")}
        for name in self._BY_NAME:
            ordered[name] = by_name(getattr(self, name))
        ordered["tensors"] = values["tensors"]
        return ordered

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        schema = super().json_schema()
        schema["properties"].update(dict.fromkeys(cls._BY_NAME, BUCKETS_SCHEMA))
        return schema
