"""MODEL and PATH on the command line: the help texts shared by every command; resolution lives in
:mod:`slimtorch.models.spec` and :mod:`slimtorch.sources.hub_cache`, where the Python API finds it too."""

from __future__ import annotations

SPEC_HELP = "the model: package.module:factory or path/to/file.py:factory (a class or a function)"
HUB_ID_HELP = (
    "a Hub repo id (org/name or org/name@revision) found in the local Hugging Face cache, never downloaded"
)
PATH_HELP = f"checkpoint file, Hugging Face model folder, or {HUB_ID_HELP}"
"""PATH on the commands that read a checkpoint (inspect, load, shrink)."""

__all__ = ["HUB_ID_HELP", "PATH_HELP", "SPEC_HELP"]
