"""What :func:`slimtorch.load` and :func:`slimtorch.load_model` are told to do (:class:`LoadOptions`), and
what they tell back (:class:`LoadReport`: where the time went, every name left out, and the result)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from slimtorch.errors import OptionError
from slimtorch.format.names import Skipped, rename_rules
from slimtorch.format.verbs import NOT_JSON, Report
from slimtorch.loading.model_slots import Matching

MODEL_ONLY = {"strict": True, "prefix": None, "rename": ()}
"""Options that match a file's names to a model's, with their defaults: :func:`slimtorch.load` has no
model, so any other value of them is refused there."""


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint is loaded; every field has the default the CLI has.

    Example:
        >>> LoadOptions(device="cpu", rename={"lstm.": "rnn."}).rename
        (('lstm.', 'rnn.'),)
    """

    device: str | None = None
    """Where the tensors go ("cpu", "cuda", "cuda:1"; a ``torch.device`` is kept as its name); None: the CPU
    for new tensors, and where they already are for a built model's."""
    dtype: torch.dtype | None = None
    """Floating-point tensors are converted to it; None: the dtype the model declares (as stored without
    a model)."""
    strict: bool = True
    """Refuse a file that lacks a tensor of the model or holds one the model does not have (load_model
    only). Parameters of a factory-built model must come from the file whatever it says, and a file that
    matches no name at all is refused either way."""
    verify: bool = True
    """Check the CRC-32 of every part of a slim file (a mismatch names the tensor)."""
    threads: int | None = None
    """Decode threads (None: one per core, up to 4)."""
    allow_globals: tuple[str, ...] = ()
    """Pickle globals to trust in a ``torch.save`` file (only for files you trust)."""
    prefix: str | None = None
    """The wrapper the model's names sit under in the file (``"model_state."``; load_model only); None:
    found by matching (:func:`~slimtorch.format.names.find_prefix`), at any depth."""
    rename: tuple[tuple[str, str], ...] = ()
    """(old, new) name prefixes replaced in the file's names once the wrapper prefix is off (load_model
    only); a mapping or ``"old=new"`` strings are taken too (``{"lstm.": "rnn."}``; ``{"": "bert."}`` puts a
    prefix in front of all)."""

    def __post_init__(self) -> None:
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise OptionError(f"dtype takes a torch.dtype (torch.bfloat16), not {self.dtype!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise OptionError(f"threads must be 1 or more, not {self.threads!r}")
        if isinstance(self.allow_globals, str):  # one global, not its characters
            raise OptionError(f"allow_globals takes a list of names, not the string {self.allow_globals!r}")
        object.__setattr__(self, "allow_globals", tuple(self.allow_globals))
        object.__setattr__(self, "rename", rename_rules(self.rename))

    def model_only_given(self) -> str | None:
        """The first option set that only a load into a model uses (None: none is)."""
        return next((name for name, default in MODEL_ONLY.items() if getattr(self, name) != default), None)


@dataclass
class LoadReport(Report):
    """Where the time of one load went, what the file's names became, and the result: ``model`` (from
    :func:`slimtorch.load_model`) or ``tensors`` (from :func:`slimtorch.load`). Phase times are summed over
    the worker threads, so they can add up to more than ``wall_s``; ``to_dict()`` is the ``--json`` output,
    where ``model_class`` and ``tensor_count`` are named ``model`` and ``tensors`` (the schema's names from
    before the report held the results).
    """

    SCHEMA: ClassVar[str] = "slimtorch.load-profile/1"
    JSON_NAMES: ClassVar[dict[str, str]] = {"model_class": "model", "tensor_count": "tensors"}

    path: str
    format: str
    device: str
    threads: int
    model_class: str | None = None
    """The model's class (None: tensors loaded without a model)."""
    tensor_count: int = 0
    bytes: int = 0
    """Bytes of the loaded tensors, as the model holds them."""
    file_bytes: int = 0
    zero_copy: int = 0
    """Tensors that are the file's bytes themselves (memory-mapped, no copy)."""
    decoded: int = 0
    open_s: float = 0.0
    """Parsing the file's structure (headers, index, pickle)."""
    construct_s: float = 0.0
    """Calling the model factory with parameters on the meta device."""
    read_s: float = 0.0
    """Mapping parts and verifying their checksums (which reads every stored byte)."""
    decode_s: float = 0.0
    copy_s: float = 0.0
    """dtype conversion, copies into existing tensors, host-to-device transfer."""
    assign_s: float = 0.0
    """Putting the tensors into the model."""
    wall_s: float = 0.0
    by_codec: dict[str, int] = field(default_factory=dict)
    prefix: str = ""
    """The wrapper prefix the model's names were read under in the file (``model_state.``)."""
    model_prefix: str = ""
    """A prefix of the model's names that the file lacks (``bert.``: a base model saved alone)."""
    ignored: list[Skipped] = field(default_factory=list)
    """Names left out because the model declares it does without them, each with the reason."""
    unmatched: list[str] = field(default_factory=list)
    """File names under the prefix that the model lacks, left out (strict=False)."""
    missing: list[str] = field(default_factory=list)
    """Model names the file lacks, left at the model's own values (strict=False)."""
    outside_prefix: list[str] = field(default_factory=list)
    """File names outside the wrapper prefix (optimizer state, ...), not the model's."""
    notes: list[str] = field(default_factory=list)
    """What the load did differently from the fast path, and why."""
    model: nn.Module | None = field(default=None, repr=False, compare=False, metadata=NOT_JSON)
    """The loaded model (:func:`slimtorch.load_model`)."""
    tensors: dict[str, torch.Tensor] | None = field(
        default=None, repr=False, compare=False, metadata=NOT_JSON
    )
    """Every tensor of the file by name (:func:`slimtorch.load`)."""

    def record(self, matching: Matching) -> None:
        """Keep what name matching decided."""
        self.prefix, self.model_prefix = matching.prefix.file, matching.prefix.model
        self.ignored, self.unmatched = matching.ignored, matching.unmatched
        self.missing, self.outside_prefix = matching.missing, matching.outside
        self.notes += matching.notes

    def to_dict(self) -> dict[str, Any]:
        return {self.JSON_NAMES.get(key, key): value for key, value in super().to_dict().items()}

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        schema = super().json_schema()
        schema["properties"] = {cls.JSON_NAMES.get(k, k): v for k, v in schema["properties"].items()}
        schema["required"] = sorted(cls.JSON_NAMES.get(k, k) for k in schema["required"])
        return schema


LoadProfile = LoadReport
"""The report's name before it held the results (``load_model_profiled`` returned it)."""
