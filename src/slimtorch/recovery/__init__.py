"""Recover: fine-tune or distil a pruned or quantized model back (:func:`recover`)."""

from slimtorch.recovery.training import RecoverReport, recover

__all__ = ["RecoverReport", "recover"]
