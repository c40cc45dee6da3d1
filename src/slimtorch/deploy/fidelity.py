"""A text model's real output, its sentence embedding, compared by cosine: what int8 export is held to.

Quantization moves every hidden value a little; an output's largest error relative to its largest
magnitude then says little about what a user sees. MiniLM in onnxruntime's dynamic int8 keeps its
sentence embeddings at cosine 0.99 to float32 while its largest element is 14-22% off. For a text model
(an ``input_ids`` input) the embedding is what retrieval, clustering and similarity read:

- a sentence-transformers model's ``sentence_embedding`` output (its own pooling and normalisation, in
  the exported graph), or
- the mean of ``last_hidden_state`` over the tokens the ``attention_mask`` keeps (sentence-transformers'
  default pooling), for a Hugging Face encoder.

:func:`embedding_agreement` gives the worst cosine over every text of every sample; an export tolerance
with ``min_cosine`` decides on it (see :data:`slimtorch.deploy.export.INT8_TEXT`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from slimtorch.deploy.runner import cosines, embeddings  # numpy only: the bundle's runner uses them too

MIN_COSINE = 0.99
"""the least cosine a text's embedding may have to eager float32 (issue 18's bound for int8)"""
SENTENCE_OUTPUT = "sentence_embedding"
HIDDEN_OUTPUT = "last_hidden_state"


@dataclass(frozen=True)
class EmbeddingSource:
    """Where a text model's embedding comes from: an output as it is, or an output mean-pooled."""

    output: str
    pooled: bool
    """mean over the sequence axis (of the tokens ``mask`` keeps); False: the output is the embedding"""
    mask: str | None

    def describe(self) -> str:
        if not self.pooled:
            return f"the model's {self.output} output"
        over = f"the tokens {self.mask} keeps" if self.mask else "every token"
        return f"mean of {self.output} over {over}"


@dataclass(frozen=True)
class EmbeddingAgreement:
    """How close the exported model's embeddings are to eager PyTorch's, over every text compared."""

    source: str
    min_cosine: float
    mean_cosine: float
    texts: int
    required: float
    passed: bool

    def summary(self, decides: bool) -> str:
        """One line for the terminal: the worst cosine, and whether it decides the check."""
        verdict = (
            f"needs >= {self.required:g}: {'passes' if self.passed else 'FAILS'}"
            if decides
            else "reported; the outputs' errors decide"
        )
        return (
            f"sentence embedding ({self.source}): cosine to eager {self.min_cosine:.4f} at worst, "
            f"{self.mean_cosine:.4f} on average over {self.texts} texts; {verdict}"
        )


def embedding_source(
    input_names: Sequence[str], outputs: Sequence[tuple[str, tuple[int, ...]]]
) -> EmbeddingSource | None:
    """The embedding of a model with these inputs and (name, shape) outputs; None when it is not a text
    model, or has neither a sentence embedding nor per-token hidden states (a classifier's logits).

    Example:
        >>> embedding_source(["input_ids", "attention_mask"], [("last_hidden_state", (2, 7, 32))])
        EmbeddingSource(output='last_hidden_state', pooled=True, mask='attention_mask')
    """
    if "input_ids" not in input_names:
        return None
    shapes = dict(outputs)
    if len(shapes.get(SENTENCE_OUTPUT, ())) == 2:
        return EmbeddingSource(SENTENCE_OUTPUT, False, None)
    mask = "attention_mask" if "attention_mask" in input_names else None
    if len(shapes.get(HIDDEN_OUTPUT, ())) == 3:
        return EmbeddingSource(HIDDEN_OUTPUT, True, mask)
    return None


def embedding_agreement(
    source: EmbeddingSource,
    inputs: Sequence[Mapping[str, np.ndarray]],
    expected: Sequence[Mapping[str, np.ndarray]],
    actual: Sequence[Mapping[str, np.ndarray]],
    required: float = MIN_COSINE,
) -> EmbeddingAgreement:
    """The worst and mean embedding cosine (exported vs eager) over every text of every sample.

    Example:
        >>> src = EmbeddingSource("sentence_embedding", False, None)
        >>> want = [{"sentence_embedding": np.array([[1.0, 0.0], [0.0, 1.0]])}]
        >>> got = [{"sentence_embedding": np.array([[1.0, 0.1], [0.0, 1.0]])}]
        >>> round(embedding_agreement(src, [{}], want, got).min_cosine, 4)
        0.995
    """
    found = np.concatenate(
        [
            cosines(embeddings(asdict(source), given, want), embeddings(asdict(source), given, got))
            for given, want, got in zip(inputs, expected, actual, strict=True)
        ]
    )
    worst = float(found.min()) if found.size else 1.0
    mean = float(found.mean()) if found.size else 1.0
    return EmbeddingAgreement(source.describe(), worst, mean, int(found.size), required, worst >= required)
