"""`slimtorch ops`: the operators a model needs from libtorch, as the list PyTorch's selective build reads."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
import yaml
from torch import nn
from torchgen.selective_build.selector import SelectiveBuilder

from slimtorch.cli import main as cli_main
from slimtorch.cli import ops_cmd
from slimtorch.deploy import ops
from slimtorch.deploy.ops import Operator, OperatorList, OperatorOptions, operators
from slimtorch.errors import OptionError, SlimtorchError
from tests.zoo.models import MLP, SmallCNN
from tests.zoo.transformers_models import bert, example

KINETO_LINE = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d .*\.cpp:\d+\] ", re.MULTILINE)


def _by_name(found: OperatorList) -> dict[str, Operator]:
    return {op.name: op for op in found.operators}


class Branchy(nn.Module):
    """Control flow on a tensor's value: torch.export cannot capture it, eager runs it fine."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x).relu()
        return self.fc(x)


class Talkative(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("the model speaks on stderr", file=sys.stderr)
        return x * 2


class Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 3)


@pytest.fixture
def run_cli(monkeypatch):
    """``slimtorch`` with the ops command registered, however far cli/main.py has got."""
    if ops_cmd not in cli_main.COMMANDS:
        monkeypatch.setattr(cli_main, "COMMANDS", (*cli_main.COMMANDS, ops_cmd))
    return cli_main.main


def test_small_cnn_lists_conv2d_as_root_and_the_convolution_it_reaches_inside():
    found = _by_name(operators(SmallCNN(), torch.randn(2, 1, 16, 16)))

    assert found["aten::conv2d"] == Operator("aten::conv2d", root=True, count=2)
    for inside in ("aten::convolution", "aten::_convolution"):
        assert found[inside].root is False and found[inside].count == 2
    # ... and the CPU kernel it ends in, whichever this build has
    assert {"aten::mkldnn_convolution", "aten::_slow_conv2d_forward"} & set(found)
    assert {name for name, op in found.items() if op.root} == {
        "aten::conv2d",
        "aten::batch_norm",
        "aten::relu",
        "aten::adaptive_avg_pool2d",
        "aten::flatten.using_ints",
        "aten::linear",
    }


def test_linear_is_a_root_that_calls_addmm_and_t_inside_it():
    found = _by_name(operators(MLP(), torch.randn(4, 64)))

    assert found["aten::linear"] == Operator("aten::linear", root=True, count=3)
    assert found["aten::addmm"] == Operator("aten::addmm", root=False, count=3)
    assert found["aten::t"].root is False
    assert list(found)[:2] == ["aten::linear", "aten::relu"]  # roots first, then by name


def test_yaml_loads_in_pyyaml_and_torchgen_which_select_each_recorded_op_and_nothing_else():
    found = operators(SmallCNN(), torch.randn(2, 1, 16, 16))
    text = found.to_yaml("tests.zoo.models:SmallCNN")

    data = yaml.safe_load(text)
    assert data["include_all_operators"] is False
    assert data["include_all_non_op_selectives"] is True  # no kernel dtypes recorded: keep them all
    assert list(data["operators"]) == [op.name for op in found.operators]
    assert text.startswith("# The operators tests.zoo.models:SmallCNN uses")
    assert f"torch {torch.__version__}" in text and "SELECTED_OP_LIST" in text

    selector = SelectiveBuilder.from_yaml_str(text)
    for op in found.operators:
        assert selector.is_operator_selected(op.name), op.name
        assert selector.is_root_operator(op.name) is op.root, op.name
        assert selector.is_operator_selected_for_training(op.name) is False
    assert not selector.is_operator_selected("aten::lstm")
    assert not selector.is_operator_selected("aten::conv2d.padding")  # an overload the model never called
    assert selector.is_kernel_dtype_selected("add_kernel", "Float")


def test_training_adds_backward_ops_and_leaves_the_model_as_it_was():
    model = SmallCNN().eval()
    stats = model.features[1].running_mean.clone()

    found = operators(model, torch.randn(2, 1, 16, 16), training=True)

    names = _by_name(found)
    assert {"aten::convolution_backward", "aten::native_batch_norm_backward", "aten::mm"} <= set(names)
    assert names["aten::add_.Tensor"].root  # train-mode BatchNorm counts its batches
    selector = SelectiveBuilder.from_yaml_str(found.to_yaml("cnn"))
    assert selector.is_operator_selected_for_training("aten::convolution_backward")
    assert yaml.safe_load(found.to_yaml("cnn"))["operators"]["aten::conv2d"]["is_used_for_training"] is True
    assert found.training and found.to_dict()["training"]
    assert not model.training and not any(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.features[1].running_mean, stats)


def test_inference_runs_in_eval_mode_and_restores_train_mode():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))

    found = _by_name(operators(model, torch.randn(2, 4)))

    assert "aten::bernoulli_.float" not in found and "aten::native_dropout" not in found
    assert model.training


def test_tiny_bert_lists_embedding_and_attention_with_the_kernels_inside():
    found = operators(bert(), example("bert"))

    names = _by_name(found)
    assert not found.notes
    for root in ("aten::embedding", "aten::linear", "aten::layer_norm", "aten::scaled_dot_product_attention"):
        assert names[root].root, root
    assert not names["aten::addmm"].root and not names["aten::native_layer_norm"].root
    assert SelectiveBuilder.from_yaml_str(found.to_yaml("bert")).is_operator_selected("aten::index_select")


def test_a_model_torch_export_cannot_capture_still_gets_the_dispatched_list_and_a_note():
    found = operators(Branchy(), torch.ones(2, 4))

    names = _by_name(found)
    assert {"aten::linear", "aten::addmm", "aten::relu"} <= set(names)
    assert not any(op.root for op in found.operators)
    assert len(found.notes) == 1 and "torch.export" in found.notes[0]
    text = found.to_yaml("branchy")
    assert "# note: no operator is marked is_root_operator" in text
    assert SelectiveBuilder.from_yaml_str(text).is_operator_selected("aten::addmm")


def test_without_overload_names_the_ops_inside_are_listed_with_all_overloads(monkeypatch):
    monkeypatch.setattr(ops, "_overload_names_config", lambda: None)  # a torch whose profiler has none

    found = operators(MLP(), torch.randn(4, 64))

    names = _by_name(found)
    assert names["aten::addmm"].all_overloads and names["aten::linear"].all_overloads
    assert "aten::transpose" in names  # the bare name, not aten::transpose.int
    assert any("overload" in note for note in found.notes)
    selector = SelectiveBuilder.from_yaml_str(found.to_yaml("mlp"))
    assert selector.is_operator_selected("aten::transpose.int")
    assert not selector.is_operator_selected("aten::lstm")


def test_stderr_keeps_the_models_own_lines_but_not_the_profilers_log(capfd):
    operators(Talkative(), torch.ones(2))

    err = capfd.readouterr().err
    assert "the model speaks on stderr" in err
    assert not KINETO_LINE.search(err)


def test_a_model_that_fails_on_the_example_says_so_in_one_line():
    with pytest.raises(SlimtorchError, match=r"the model failed on the example input: .*mat"):
        operators(Broken(), torch.ones(2, 4))


def test_cli_writes_the_yaml_atomically_and_prints_a_summary(run_cli, tmp_path, capsys):
    out = tmp_path / "deploy" / "ops.yaml"

    code = run_cli(["ops", "tests.zoo.models:MLP", "--input-shape", "2,64", "-o", str(out)])

    assert code == 0
    found = yaml.safe_load(out.read_text())["operators"]
    roots = sum(op["is_root_operator"] for op in found.values())
    summary = capsys.readouterr().out.strip()
    assert (
        summary
        == f"{len(found)} operators ({roots} called by the model, {len(found) - roots} inside them) -> {out}"
    )
    assert [p.name for p in out.parent.iterdir()] == ["ops.yaml"]  # no temporary file left beside it
    assert SelectiveBuilder.from_yaml_path(str(out)).is_operator_selected("aten::addmm")


def test_cli_prints_yaml_by_default_and_json_on_request(run_cli, capsys):
    assert run_cli(["ops", "tests.zoo.models:MLP", "--input-shape", "2,64"]) == 0
    printed = capsys.readouterr().out
    assert SelectiveBuilder.from_yaml_str(printed).is_operator_selected("aten::linear")

    assert run_cli(["ops", "tests.zoo.models:MLP", "--input-shape", "2,64", "--training", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["training"] is True and data["roots"] == sum(op["root"] for op in data["operators"])
    assert {"name": "aten::addmm", "root": False, "count": 3, "all_overloads": False} in data["operators"]
    assert "aten::mm" in {op["name"] for op in data["operators"]}


def test_cli_turns_a_failing_model_into_exit_code_2(run_cli, capsys):
    assert run_cli(["ops", "tests.zoo.models:MLP", "--input-shape", "2,3"]) == 2
    assert "does not accept an input of shape 2,3" in capsys.readouterr().err  # checked before any tracing


def test_options_by_dataclass_and_by_override_give_the_same_list():
    x = torch.randn(4, 64)
    given = operators(MLP(), x, OperatorOptions(training=True))
    overridden = operators(MLP(), x, training=True)
    assert given.to_dict() == overridden.to_dict() and given.training
    assert operators(MLP(), x, OperatorOptions(training=True), training=False).training is False


def test_an_unknown_option_names_the_fields_and_records_nothing():
    with pytest.raises(OptionError, match="operators: unknown option 'train'; OperatorOptions has: training"):
        operators(Broken(), torch.ones(2, 4), train=True)  # raised before the model runs
    with pytest.raises(OptionError, match="options must be a OperatorOptions, not bool"):
        operators(MLP(), torch.randn(4, 64), True)


def test_the_list_as_json_fits_its_schema_key_for_key():
    data = operators(MLP(), torch.randn(4, 64)).to_dict()
    schema = OperatorList.json_schema()
    assert data["schema"] == "slimtorch.operators/1" == schema["properties"]["schema"]["const"]
    assert set(data) == set(schema["properties"]) == {
        "schema", "operators", "total", "roots", "training", "torch", "notes"
    }  # fmt: skip
    assert set(data["operators"][0]) == set(schema["properties"]["operators"]["items"]["properties"])
    assert data["total"] == len(data["operators"]) and data["torch"] == torch.__version__
