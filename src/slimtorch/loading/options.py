"""What :func:`slimtorch.load` and :func:`slimtorch.load_model` are told to do (:class:`LoadOptions`), and
what they tell back (:class:`LoadReport`: where the time went, every name left out, and the result)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from slimtorch.errors import OptionError
from slimtorch.format.names import Skipped, rename_rules
from slimtorch.format.pending import Checks
from slimtorch.format.units import parse_size
from slimtorch.format.verbs import NOT_JSON, Report
from slimtorch.loading.model_slots import Matching

MODEL_ONLY = {"strict": True, "prefix": None, "rename": (), "max_memory": (), "offload": "none"}
MODEL_ONLY |= {"mesh": None, "placements": "fsdp"}  # sharded loading (issue 22)
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
    verify: bool | str = "eager"
    """Check the CRC-32 of every part of a slim file (a mismatch raises
    :class:`~slimtorch.FormatError` naming the file and tensor). ``"eager"`` (``True`` means it): every
    check is done, on several threads, before load_model returns. ``"before-use"`` (opt in): load_model
    returns once the model holds the file's mapped bytes, the checks run on threads of their own, and each
    module's forward waits for its own tensors' (raising there on a mismatch); the report's ``wait()``
    waits for all, and save, quantize, prune and export wait first; copying or pickling the model before
    the checks are done is refused. ``False``: none. Decoded tensors are always checked before decoding,
    and :func:`slimtorch.load` (no model, no forward) always waits."""
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

    # -- offload (issue 22): a model larger than the memory it may hold ----------------------------------
    max_memory: tuple[tuple[str, int], ...] = ()
    """The most the loaded model may hold, per device, in bytes (load_model only): a mapping or pairs,
    sizes as numbers or text (``{"cpu": "4GB"}``, ``"cpu=512MiB"``). Only ``"cpu"`` is built. Units of the
    model (blocks) fill it in forward order; the rest need ``offload="disk"``. (): no limit."""
    offload: str = "none"
    """What happens to the units beyond ``max_memory``: ``"none"`` (a model over it is refused) or
    ``"disk"`` (they stay memory-mapped from the checkpoint, paged in by each forward and released after
    it: inference only, see :mod:`slimtorch.loading.offload`)."""

    # -- sharded loading (issue 22): each rank of FSDP2 / tensor parallel reads only its own shards -------
    mesh: Any = None
    """A 1-D ``torch.distributed`` ``DeviceMesh`` to shard the model over before it is filled (load_model
    only): each rank then reads only its own rows or columns (:mod:`slimtorch.loading.sharded`). None:
    unsharded, unless the model given holds DTensors already (sharded by you), which are filled alike."""
    placements: str | tuple[tuple[str, str], ...] = "fsdp"
    """How ``mesh`` shards the model: ``"fsdp"`` (FSDP2 ``fully_shard`` on each repeated block, then the
    root) or a tensor-parallel plan, module name patterns to ``"colwise"``, ``"rowwise"`` or
    ``"replicate"`` (``{"layers.*.up": "colwise", "layers.*.down": "rowwise"}``)."""

    def __post_init__(self) -> None:
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise OptionError(f"dtype takes a torch.dtype (torch.bfloat16), not {self.dtype!r}")
        object.__setattr__(self, "verify", _verify_mode(self.verify))
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise OptionError(f"threads must be 1 or more, not {self.threads!r}")
        if isinstance(self.allow_globals, str):  # one global, not its characters
            raise OptionError(f"allow_globals takes a list of names, not the string {self.allow_globals!r}")
        object.__setattr__(self, "allow_globals", tuple(self.allow_globals))
        object.__setattr__(self, "rename", rename_rules(self.rename))
        object.__setattr__(self, "max_memory", _max_memory(self.max_memory))
        if self.offload not in OFFLOAD_MODES:
            raise OptionError(f"offload takes {' or '.join(map(repr, OFFLOAD_MODES))}, not {self.offload!r}")
        if self.offload == "disk" and not self.max_memory:
            raise OptionError("offload='disk' needs a budget to offload beyond: max_memory={'cpu': '4GB'}")
        object.__setattr__(self, "placements", _placements(self.placements, self.mesh, self.offload))

    def model_only_given(self) -> str | None:
        """The first option set that only a load into a model uses (None: none is)."""
        return next((name for name, default in MODEL_ONLY.items() if getattr(self, name) != default), None)


VERIFY_MODES = ("eager", "before-use")
TP_STYLES = ("colwise", "rowwise", "replicate")


def _placements(value: object, mesh: object, offload: str) -> str | tuple[tuple[str, str], ...]:
    """``placements`` as ``"fsdp"`` or (pattern, style) pairs; the mesh checked to be 1-D (sharded loads
    of 2-D meshes, FSDP over TP, are not built)."""
    if mesh is not None and getattr(mesh, "ndim", None) != 1:
        raise OptionError(
            f"mesh takes a 1-D DeviceMesh, not {type(mesh).__name__} of ndim {getattr(mesh, 'ndim', None)}"
        )
    if mesh is not None and offload != "none":
        raise OptionError("a sharded load (mesh=) does not offload: give one or the other")
    if value == "fsdp":
        return "fsdp"
    pairs = tuple(value.items()) if isinstance(value, dict) else value
    if mesh is None or not isinstance(pairs, tuple) or not pairs:
        problem = "it needs mesh=" if mesh is None else f"not {value!r}"
        raise OptionError(f"placements takes 'fsdp' or a plan {{pattern: 'colwise'}} ({problem})")
    for pair in pairs:
        if not (
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and pair[1] in TP_STYLES
        ):
            raise OptionError(f"placements: {pair!r} is not a (pattern, one of {', '.join(TP_STYLES)}) pair")
    return pairs


OFFLOAD_MODES = ("none", "disk")
MEMORY_DEVICES = ("cpu",)


def _max_memory(value: object) -> tuple[tuple[str, int], ...]:
    """``max_memory`` as (device, bytes) pairs, from a mapping, pairs or ``"device=size"`` strings."""
    if isinstance(value, str):
        value = [value]
    given: Any = value.items() if isinstance(value, dict) else value  # anything: TypeError if not pairs
    try:
        pairs = [tuple(p.split("=", 1)) if isinstance(p, str) else tuple(p) for p in given]
    except TypeError:
        raise OptionError(f"max_memory takes a mapping like {{'cpu': '4GB'}}, not {value!r}") from None
    out = []
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in MEMORY_DEVICES:
            raise OptionError(
                f"max_memory: {pair!r} is not a budget this build has: only 'cpu' (like {{'cpu': '4GB'}}); "
                "GPU placement with offload is not built yet"
            )
        device, size = pair
        size = parse_size(size) if isinstance(size, str) else size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise OptionError(f"max_memory[{device!r}] must be a positive size, not {size!r}")
        out.append((device, size))
    return tuple(out)


def _verify_mode(value: object) -> str | bool:
    """``verify`` as one of its modes or False; True is the default mode, ``"eager"`` (what ``verify=True``
    meant before the modes existed: every checksum checked before the load returns)."""
    if value is True:
        return "eager"
    if value is False or value in VERIFY_MODES:
        return value
    raise OptionError(f"verify takes 'eager', 'before-use', True or False, not {value!r}")


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
    """Parsing the file's structure (headers, index, pickle) and laying out its file-wide checks."""
    construct_s: float = 0.0
    """Calling the model factory with parameters on the meta device."""
    read_s: float = 0.0
    """Mapping parts, and verifying the checksums of parts decoded or copied (before their bytes are
    used)."""
    decode_s: float = 0.0
    copy_s: float = 0.0
    """dtype conversion, copies into existing tensors, host-to-device transfer."""
    assign_s: float = 0.0
    """Putting the tensors into the model."""
    wall_s: float = 0.0
    verify: str = "off"
    """How checksums were verified: ``"eager"`` (before the load returned), ``"before-use"`` (beside the
    caller's work: see ``verify_after_s``), ``"off"``."""
    verify_s: float = 0.0
    """Hashing the mapped tensors' bytes (which pages them in), summed over the verifying threads; filled
    in as the checks run."""
    verified_bytes: int = 0
    """Bytes of mapped tensors checked so far (decoded tensors' parts are counted in ``read_s``)."""
    verify_wall_s: float = 0.0
    """From the first check to the last, once all are done."""
    verify_after_s: float = 0.0
    """How long the checks went on after the load returned (0: none did: nothing overlapped)."""
    verify_waited_s: float = 0.0
    """Time forwards and ``wait()`` spent blocked on checks."""
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

    checks: Checks | None = field(default=None, repr=False, compare=False, metadata=NOT_JSON)
    """The checks still running (``verify="before-use"``); :meth:`wait` waits for them."""

    # -- offload (issue 22) ----------------------------------------------------------------------------
    offload: str = "none"
    """``"disk"``: units beyond ``max_memory`` stay mapped from the file (``offloaded``)."""
    max_memory: dict[str, int] = field(default_factory=dict)
    """The budget the load was given, in bytes per device."""
    offloaded: list[str] = field(default_factory=list)
    """Units (module names) whose tensors stay in the file, brought in by each forward."""
    resident_bytes: int = 0
    """Bytes of the model's tensors held in memory between forwards (the rest is ``offloaded``); with
    ``offload="none"``, 0."""
    page_release: str = ""
    """How offloaded pages leave memory after a unit's forward (``"madvise"``: MADV_DONTNEED, Linux)."""

    # -- sharded loading (issue 22) --------------------------------------------------------------------
    rank: int = 0
    """This process's rank in the model's mesh (0 and ``world_size`` 1: an unsharded load)."""
    world_size: int = 1
    bytes_read: int = 0
    """File bytes this rank read (``pread``), checksum re-reads included; 0 for an unsharded load."""
    share_bytes: int = 0
    """Bytes of this rank's tensors as the model holds them (its shards, and whatever is not sharded)."""
    verified_with: str = ""
    """How a sharded load checked checksums: ``"ranks"`` (every rank hashed its own bytes, the chunks'
    CRCs combined across ranks), ``"none"`` (the format has none), ``"off"``; ``""``: unsharded."""

    def wait(self) -> LoadReport:
        """Block until every checksum of this load is verified; raise :class:`~slimtorch.FormatError` on a
        mismatch. Returns the report, with the verification's times filled in.

        Example:
            >>> model = slimtorch.load_model("model.safetensors", Net).wait().model  # doctest: +SKIP
        """
        if self.checks is not None:
            self.checks.wait()
        return self

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
