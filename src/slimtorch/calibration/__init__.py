"""Calibration: what a model's layers see when sample inputs run through it, for the steps that choose
weights with their inputs in view (GPTQ in :mod:`slimtorch.quant`, Wanda and SparseGPT in
:mod:`slimtorch.prune`).

- :mod:`~slimtorch.calibration.moments`: each watched layer's input moments (``X^T X``, or only the
  squared norm of each input column), and the damped inverse Cholesky factor GPTQ and SparseGPT read.
- :mod:`~slimtorch.calibration.sequential`: a model of repeated blocks (a language model's decoder layers)
  calibrated one block at a time, each on the outputs of the blocks already changed, so memory holds one
  block's moments at once and each block is chosen against the inputs it will really see.
"""

from slimtorch.calibration.moments import InputMoments, inverse_cholesky, wrapping_forward
from slimtorch.calibration.sequential import Stage, blockwise, call

__all__ = ["InputMoments", "Stage", "blockwise", "call", "inverse_cholesky", "wrapping_forward"]
