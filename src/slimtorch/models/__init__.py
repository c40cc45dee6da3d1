"""Models as users name them: a factory spec, a Hugging Face folder or a sentence-transformers folder.

:func:`open_model` builds the model, loads its weights with slimtorch's safe loader and finds an example
input it accepts; every CLI command that takes a MODEL starts from it.

Example:
    >>> from slimtorch.models import open_model
    >>> opened = open_model("torch.nn:Identity", input_shape=(2, 8))
    >>> opened.model(*opened.args).shape
    torch.Size([2, 8])
"""

from slimtorch.models.opening import ModelInput, open_meta_model, open_model
from slimtorch.models.sentence import SentenceEmbedder

__all__ = ["ModelInput", "SentenceEmbedder", "open_meta_model", "open_model"]
