"""Models as users name them: Hugging Face configs (:mod:`~slimtorch.models.hub`), sentence-transformers
folders (:mod:`~slimtorch.models.sentence`), ``pkg.module:factory`` specs (:mod:`~slimtorch.models.spec`),
and an example input each accepts (:mod:`~slimtorch.models.examples`).

:func:`slimtorch.open_model` (in :mod:`slimtorch.loading.opening`) puts these together with the loader.
"""

from slimtorch.models.sentence import SentenceEmbedder

__all__ = ["SentenceEmbedder"]
