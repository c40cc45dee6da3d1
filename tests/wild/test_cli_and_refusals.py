"""The wild checkpoints from the command line, and what a user gets before they give the options a file
needs: one line saying which names do not match and how to map them."""

from __future__ import annotations

import pytest

import slimtorch
from slimtorch.cli.main import main
from slimtorch.errors import SlimtorchError
from slimtorch.sources.allowed_globals import importable_global
from tests.wild.models import BY_NAME, MODEL_ONLY, PESTO, RESEMBLYZER, SILERO_JIT, WildModel, pesto
from tests.wild.reimplemented import JIT_RENAME, SileroVAD, VoiceEncoder


def cli_options(load: dict) -> list[str]:
    """``load_model``'s keyword arguments as ``slimtorch load`` flags."""
    flags = ["--non-strict"] if load.get("strict") is False else []
    if "prefix" in load:
        flags += ["--prefix", load["prefix"]]
    for old, new in load.get("rename", {}).items():
        flags += ["--rename", f"{old}={new}"]
    return flags


@pytest.mark.parametrize("model", MODEL_ONLY, ids=str)
def test_slimtorch_load_fills_the_real_class_from_the_command_line(model: WildModel, capsys) -> None:
    code = main(["load", str(model.path), "--model", model.factory, *cli_options(dict(model.load))])
    assert code == 0, capsys.readouterr().err


def refusal(call) -> str:
    with pytest.raises(SlimtorchError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_strict_load_of_resemblyzer_names_the_training_scalars_and_the_way_round() -> None:
    message = refusal(lambda: slimtorch.load_model(RESEMBLYZER, VoiceEncoder))
    assert "similarity_weight" in message and "strict=False" in message


def test_the_cli_refuses_resemblyzer_strictly_in_one_line_with_exit_2(capsys) -> None:
    assert main(["load", str(RESEMBLYZER), "--model", BY_NAME["resemblyzer"].factory]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "similarity_weight" in err and "--non-strict" in err


def test_silero_jit_holds_two_networks_alike_and_the_refusal_asks_which() -> None:
    message = refusal(lambda: slimtorch.load_model(SILERO_JIT, SileroVAD, rename=JIT_RENAME))
    assert "_model." in message and "_model_8k." in message and "prefix" in message


def test_pesto_mir1k_predates_its_class_and_the_refusal_names_the_layer_to_rename() -> None:
    message = refusal(lambda: slimtorch.load_model(PESTO, pesto))
    assert "prefilt_layers" in message and "rename" in message


def test_a_silero_load_missing_one_rename_is_refused_not_half_filled() -> None:
    partial = dict(list(JIT_RENAME.items())[1:])  # the STFT basis left under its archive name
    message = refusal(lambda: slimtorch.load_model(SILERO_JIT, SileroVAD, prefix="_model.", rename=partial))
    assert "stft_conv.weight" in message


def test_igfold_opens_with_its_foreign_classes_as_placeholders_named_in_one_note(capsys, tmp_path) -> None:
    # its hyper-parameters pickle a BertConfig, a BertTokenizer and tokenizer classes transformers 5 no
    # longer has: each is kept inert, and only a global that can be imported is suggested
    igfold = BY_NAME["igfold"]
    assert main(["inspect", str(igfold.path)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("slimtorch: note:")]
    assert len(notes) == 1 and "inert placeholders" in notes[0], notes
    assert "tokenization_bert.BertTokenizer" in notes[0]
    suggested = notes[0].split("--allow-global ", 1)[1].split()[0]
    assert importable_global(suggested), suggested
    for extra in ([], ["--no-objects"]):
        out = tmp_path / f"igfold{len(extra)}.safetensors"
        assert main(["shrink", str(igfold.path), "-o", str(out), *extra]) == 0
        assert bool(slimtorch.load_objects(out)) is not bool(extra)


def test_quantizing_the_antiberty_folder_keeps_its_heads_for_its_own_class(capsys, tmp_path) -> None:
    # AntiBERTy is not a transformers class: slimtorch builds the BERT body from the folder; the output
    # still holds the heads, and loads into the package's class
    import torch

    from tests.wild.inputs import cosine_rows
    from tests.wild.matrix import reference, rows_of

    antiberty = BY_NAME["antiberty"]
    out = tmp_path / "antiberty-int8"
    assert (
        main(["quantize", str(antiberty.path), "-o", str(out), "--scheme", "int8-weight", "--runs", "0"]) == 0
    )
    assert "written as they are" in capsys.readouterr().out
    network = slimtorch.load_model(out, antiberty.build).model.eval()
    assert type(network.bert.encoder.layer[0].output.dense).__name__ == "Int8WeightLinear"
    original = antiberty.original()
    assert torch.equal(network.cls.species.weight, original.cls.species.weight)
    args, expected = reference(antiberty)
    assert cosine_rows(rows_of(antiberty, network, args), expected) >= 0.99
