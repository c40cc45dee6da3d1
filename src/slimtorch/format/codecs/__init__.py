"""Codecs of the slim format, registered by name and composable into chains.

=========  ==========  =========================================================================
name       lossless    what it stores
=========  ==========  =========================================================================
(none)     yes         the tensor as is ("raw")
bytes      yes         raw bytes, for dtypes safetensors cannot name
cast       no          float16 / bfloat16 copy
int8       no          int8 codes + a float32 scale per output channel (or per group of a row)
int4       no          4-bit codes two per byte + scale and zero point per group of 32..256
sparse     yes         packed bitmask + the non-zero values (those may go through a later stage)
zstd       yes         zstandard over the stored parts, where it saves >= 5% (optional, last)
=========  ==========  =========================================================================

See :mod:`slimtorch.format.codecs.lossy` for the error bounds of the lossy codecs.
"""

from slimtorch.format.codecs import lossless, lossy
from slimtorch.format.codecs.chain import REGISTRY, CodecError, Encoded, chain_label, decode, encode

__all__ = ["REGISTRY", "CodecError", "Encoded", "chain_label", "decode", "encode", "lossless", "lossy"]
