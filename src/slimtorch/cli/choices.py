"""The values the parsers offer, copied from the packages that own them.

``slimtorch --help`` and a mistyped option must answer at once, and the packages that own these values
import torch (1.5 s or more). So the command line keeps its own copy of each, and
``tests/test_cli_conventions.py`` compares every copy with its owner: a value added there and not here
fails that test, never a user. The quantization schemes need no copy: their table,
:mod:`slimtorch.schemes`, imports no torch.
"""

from __future__ import annotations

from slimtorch.schemes import SCHEMES as SCHEMES  # what --scheme offers (each command, those it can do)
from slimtorch.schemes import WRITTEN as WRITTEN  # what shrink and prune store, passed on by name

INT4_GROUP_SIZE = 128
"""``slimtorch.format.codecs.lossy.INT4_GROUP_SIZE``: int4 values per scale of ``slimtorch quantize``."""
SHRINK_INT4_GROUP_SIZE = 32
"""``slimtorch.format.policy.SHRINK_INT4_GROUP_SIZE``: the smaller groups ``shrink`` stores."""
GROUP_SIZES = range(32, 257)
"""``slimtorch.format.codecs.lossy.INT4_GROUP_SIZES``: allowed when even (checked by the same rule)."""

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-no-momentum", "adagrad", "rmsprop")
"""``slimtorch.memory.OPTIMIZERS``' names."""
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
"""``slimtorch.memory.PRECISIONS``."""
PARALLEL = ("ddp", "zero1", "fsdp", "fsdp-offload")
"""``slimtorch.memory.options.PARALLEL``."""
FIT_MARGIN = 0.05
"""``slimtorch.memory.options.FIT_MARGIN``."""

START_METHODS = ("fork", "spawn", "forkserver")
"""``slimtorch.data.options.START_METHODS``."""
TUNE_BUDGET_S = 20.0
"""``slimtorch.data.TuneOptions.budget_s``."""

DEFAULT_SHAPE = (1, 3, 224, 224)
"""``slimtorch.models.examples.DEFAULT_SHAPE``."""

VERIFY_MODES = ("eager", "before-use")
"""``slimtorch.loading.options.VERIFY_MODES``: when ``slimtorch load`` checks the checksums."""
