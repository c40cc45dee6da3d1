"""The format core: what a slim checkpoint is, and the pieces every step above shares.

- :mod:`~slimtorch.format.source`: :class:`TensorSource`, the reader protocol every format is read through.
- :mod:`~slimtorch.format.codecs`: the codecs (raw, cast, int8, int4, sparse, zstd), composable in chains.
- :mod:`~slimtorch.format.layout` and :mod:`~slimtorch.format.container`: the slim metadata inside a
  safetensors file; :mod:`~slimtorch.format.writer`: atomic, sharded, checksummed writes.
- :mod:`~slimtorch.format.delta`: the structural delta of a pruned or quantized model, with a registry
  the steps that swap layers register into.
- :mod:`~slimtorch.format.policy`: which codec each tensor gets; :mod:`~slimtorch.format.sensitive`: which
  weights stay precise; :mod:`~slimtorch.format.scan`: zeros and duplicates in a stream.
- :mod:`~slimtorch.format.names`: checkpoint names against a model's (wrapper prefixes, renames).
- :mod:`~slimtorch.format.hf_layout`: the Hugging Face folder layout (compressed-tensors).
- :mod:`~slimtorch.format.untrusted`: budgets for hostile bytes; :mod:`~slimtorch.format.progress`: the
  progress protocol; :mod:`~slimtorch.format.units`: byte counts for people.

It imports nothing of slimtorch's above :mod:`slimtorch.graph` (tests/test_layers.py holds it to that).
"""
