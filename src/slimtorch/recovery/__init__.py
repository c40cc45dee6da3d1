"""Recover: fine-tune or distil a pruned or quantized model back (:func:`recover`, with
:class:`RecoverOptions`)."""

from slimtorch.recovery.training import RecoverOptions, RecoverReport, recover

__all__ = ["RecoverOptions", "RecoverReport", "recover"]
