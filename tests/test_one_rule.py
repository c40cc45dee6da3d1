"""One rule where the code had two: a bad option is one error type from every verb, an int4 group size is
checked by one function with one default per verb, and shrink takes off the wrapper prefix load_model
finds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import slimtorch
from slimtorch.cli.main import build_parser, main
from slimtorch.format.codecs import CodecError, encode
from slimtorch.format.codecs.lossy import INT4_GROUP_SIZE, check_group_size
from slimtorch.format.policy import SHRINK_INT4_GROUP_SIZE, TensorPolicy
from slimtorch.quant.recorded import check_recorded
from tests.support.cli import one_error_line
from tests.support.specs import mlp64

# -- one error type for a bad option ----------------------------------------------------------------------
BAD_OPTIONS: dict[str, Callable[[], object]] = {
    "shrink options": lambda: slimtorch.ShrinkOptions(quantize="int3"),
    "save": lambda: slimtorch.save({"w": torch.ones(2)}, "unused.slim", sparse="maybe"),
    "quantize scheme": lambda: slimtorch.quantize(mlp64(), "int3-weight"),
    "quantize group size": lambda: slimtorch.quantize(mlp64(), "int4-weight", group_size=33),
    "quantize skip": lambda: slimtorch.quantize(mlp64(), skip=["nope"]),
    "prune channels": lambda: slimtorch.prune.channels(mlp64(), torch.randn(1, 64), ratio=1.5),
    "prune weights": lambda: slimtorch.prune.weights(mlp64(), 0.5, method="largest"),
    "load_model device": lambda: slimtorch.load_model("unused.slim", mlp64(), device="tpu:0").model,
}


@pytest.mark.parametrize("call", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_a_bad_option_is_an_option_error_both_except_clauses_catch(call) -> None:
    with pytest.raises(slimtorch.OptionError) as caught:
        call()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, slimtorch.SlimtorchError)


def test_a_bad_option_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    model = tmp_path / "net.pt"
    torch.save(mlp64().state_dict(), model)
    args = ["quantize", "tests.support.specs:mlp64", "--weights", str(model), "--input-shape", "1,64"]
    args += ["-o", str(tmp_path / "o")]
    assert main([*args, "--scheme", "int4-weight", "--group-size", "34", "--skip", "nope"]) == 2
    assert "skip pattern 'nope' matches no module" in one_error_line(capsys)


# -- one group-size check, one default per verb --------------------------------------------------------------
@pytest.mark.parametrize("size", [31, 33, 30, 258, 64.0, True, "64"])
def test_every_verb_refuses_the_same_group_sizes(size, tmp_path) -> None:
    message = "group size must be even, 32 to 256"
    with pytest.raises(slimtorch.OptionError, match=message):
        check_group_size(size)
    with pytest.raises(slimtorch.OptionError, match=message):
        slimtorch.ShrinkOptions(quantize="int4-weight", group_size=size)
    with pytest.raises(slimtorch.OptionError, match=message):
        slimtorch.quantize(mlp64(), "int4-weight", group_size=size)
    with pytest.raises(CodecError, match=message):
        encode(torch.randn(4, 64), [("int4", {"group_size": size})])
    how = {"scheme": "int4-weight", "group_size": size, "dtype": "float32"}
    with pytest.raises(slimtorch.SlimtorchError, match="not a known scheme"):
        check_recorded({"0": how})


@pytest.mark.parametrize("size", [32, 34, 128, 256])
def test_every_verb_takes_the_same_group_sizes(size) -> None:
    assert check_group_size(size) == size
    assert slimtorch.ShrinkOptions(quantize="int4-weight", group_size=size).group_size == size
    quantized = slimtorch.quantize(mlp64(), "int4-weight", group_size=size).model
    assert quantized[0].stage["group_size"] == size
    assert encode(torch.randn(4, 64), [("int4", {"group_size": size})]).stages[0]["group_size"] == size
    assert check_recorded({"0": {"scheme": "int4-weight", "group_size": size, "dtype": "float32"}})


def _cli_default(command: str, option: str) -> object:
    parser = build_parser()
    commands = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices
    return next(a for a in commands[command]._actions if option in a.option_strings).default


def test_quantize_defaults_to_the_codec_group_size_and_shrink_to_its_own_everywhere() -> None:
    """quantize, its CLI and the codec group by 128 (the packed kernel's size); shrink, save and their CLI
    by 32 (measured finer: see SHRINK_INT4_GROUP_SIZE). Each default is written once."""
    assert INT4_GROUP_SIZE == 128 and SHRINK_INT4_GROUP_SIZE == 32
    assert slimtorch.quant.QuantizeOptions().group_size == INT4_GROUP_SIZE
    assert _cli_default("quantize", "--group-size") == INT4_GROUP_SIZE
    assert slimtorch.quantize(mlp64(), "int4-weight").model[0].stage["group_size"] == INT4_GROUP_SIZE
    assert TensorPolicy.of(slimtorch.ShrinkOptions()).group_size == SHRINK_INT4_GROUP_SIZE
    assert slimtorch.ShrinkOptions().group_size == SHRINK_INT4_GROUP_SIZE
    assert _cli_default("shrink", "--group-size") == SHRINK_INT4_GROUP_SIZE


def test_shrink_cli_refuses_a_bad_group_size_while_parsing(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["shrink", str(tmp_path / "never-read.pt"), "-o", str(tmp_path / "o"), "--group-size", "33"])
    assert done.value.code == 2
    assert "int4 group size must be even, 32 to 256, not 33" in capsys.readouterr().err


# -- one wrapper-prefix rule ---------------------------------------------------------------------------------
def _wrapped(prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + name: tensor for name, tensor in mlp64().state_dict().items()}


_OPTIMIZER = {"state": {0: {"exp_avg": torch.zeros(64, 64)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
CHECKPOINTS = {
    # torch's own wrappers: DataParallel / DistributedDataParallel and torch.compile
    "DataParallel state dict": (_wrapped("module."), "module."),
    "torch.compile state dict": (_wrapped("_orig_mod."), "_orig_mod."),
    "DDP model in a training dict": (
        {"model": _wrapped("module."), "optimizer": _OPTIMIZER, "epoch": 3},
        "model.module.",
    ),
    "compiled model in a training dict": ({"model": _wrapped("_orig_mod."), "epoch": 3}, "model._orig_mod."),
    # a training script's dicts, with and without torch's wrappers
    "training dict": ({"model": _wrapped(""), "optimizer": _OPTIMIZER, "epoch": 3}, "model."),
    "nested dicts": ({"model": {"state_dict": _wrapped("")}, "epoch": 1}, "model.state_dict."),
    "flat training file": ({**_wrapped("net."), "epoch": 1}, "net."),
    "plain state dict": (_wrapped(""), ""),
}


@pytest.mark.parametrize(("checkpoint", "prefix"), CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_shrink_takes_off_the_wrapper_prefix_load_model_finds(checkpoint, prefix, tmp_path) -> None:
    path, out = tmp_path / "checkpoint.pt", tmp_path / "out.slim"
    torch.save(checkpoint, path)
    report = slimtorch.shrink(path, out)
    profile = slimtorch.load_model(path, mlp64())
    assert (report.renamed_prefix or "") == profile.prefix == prefix
    mlp64().load_state_dict(slimtorch.load(out).tensors)  # the shrunk file holds the model's own names


def test_safetensors_from_a_data_parallel_model_loses_its_module_prefix(tmp_path) -> None:
    path = tmp_path / "ddp.safetensors"
    save_file({k: v.contiguous() for k, v in _wrapped("module.").items()}, path)
    report = slimtorch.shrink(path, tmp_path / "out.slim")
    assert report.renamed_prefix == slimtorch.load_model(path, mlp64()).prefix == "module."


def test_a_folder_whose_weights_all_start_with_model_keeps_its_names(tmp_path: Path) -> None:
    """``model.`` is a wrapper only in a training checkpoint: a safetensors file of a model whose own names
    start with it (no training state) keeps them."""
    path = tmp_path / "lm.safetensors"
    save_file({k: v.contiguous() for k, v in _wrapped("model.").items()}, path)
    assert slimtorch.shrink(path, tmp_path / "out.slim").renamed_prefix is None
