"""Recover: fine-tune or distil a pruned or quantized model back (:func:`recover`, with
:class:`RecoverOptions`), on task data named by a spec (:func:`open_data`: ``digits``, a folder of arrays,
a factory) and scored by :func:`evaluate`."""

from slimtorch.recovery.data import TaskData, evaluate, open_data
from slimtorch.recovery.training import RecoverOptions, RecoverReport, recover

__all__ = ["RecoverOptions", "RecoverReport", "TaskData", "evaluate", "open_data", "recover"]
