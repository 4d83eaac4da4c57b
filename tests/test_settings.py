"""Execution settings declared by the layer, scored by memory/ (issue #42 item 5a): a tunable
leaf lists its settings per call (``edgetl.cost.Setting``), runs as its ``execution`` says and
makes configured copies; ``fit_schedule`` scores the candidates on those copies, and a
``Schedule`` stores the frozen conv's three as schedules always have been stored."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import edgetl.memory.schedule as schedule_module
import edgetl.models.lean.frozen as lean_module
from edgetl.cost import CallShape, Setting, Tunable
from edgetl.memory.leaf import signature
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import Schedule, apply_schedule, fit_schedule
from edgetl.models.backbone import BackboneSpec
from edgetl.models.lean import FrozenConvBNAct
from edgetl.models.side import LeanOptions, build_network

SPEC = BackboneSpec(width=0.35, num_classes=10)
RES, BATCH = 64, 4


def _conv(act="relu6", kernel=1, weight=torch.float32, act_dtype=torch.float32) -> FrozenConvBNAct:
    conv = nn.Conv2d(16, 16, kernel, padding=kernel // 2, bias=False).requires_grad_(False)
    bn = nn.BatchNorm2d(16).requires_grad_(False)
    return FrozenConvBNAct(conv, bn, act, weight_dtype=weight, act_dtype=act_dtype)


def test_a_frozen_conv_declares_its_settings_per_call(monkeypatch):
    conv = _conv()
    out = (4, 16, 8, 8)
    call = CallShape((4, 16, 8, 8), out, True, True)
    assert isinstance(conv, Tunable)
    assert conv.settings(call) == (Setting("backward", ("per_sample", "whole_batch"), "backward"),
                                   Setting("mask_chunk", (1, 2, 3, 4), "forward", bisect=True))
    # no input grad: no backward to choose; no output grad: no mask to pack
    assert [s.name for s in conv.settings(CallShape(out, out, False, True))] == ["mask_chunk"]
    assert conv.settings(CallShape(out, out, False, False)) == ()
    one = (1, 16, 8, 8)
    assert conv.settings(CallShape(one, one, True, True)) == ()  # one sample: nothing per sample
    assert _conv(act=None).settings(call) == ()
    # a 1x1 int8 weight larger than one chunk converts chunk by chunk unless told, every call
    monkeypatch.setattr(lean_module, "DEQUANT_CHUNK", 3 * 16)
    pointwise = _conv(weight=torch.int8, act_dtype=torch.bfloat16)
    assert pointwise.chunkable and pointwise.settings(call)[-1] == Setting(
        "weight", ("chunked", "whole"), "both", every_shape=True)
    assert "weight" not in [s.name for s in _conv(kernel=3, weight=torch.int8, act_dtype=torch.bfloat16).settings(call)]


def test_configured_is_a_copy_and_the_conv_runs_as_its_execution_says(monkeypatch):
    monkeypatch.setattr(lean_module, "DEQUANT_CHUNK", 3 * 16)
    conv = _conv(weight=torch.int8, act_dtype=torch.bfloat16)
    shape = (4, 16, 8, 8)
    key = signature(conv).key
    choice = {shape: {"backward": "whole_batch", "mask_chunk": 3}, None: {"weight": "whole"}}
    twin = conv.configured(choice)
    assert conv.execution == {} and signature(conv).key == key  # never changes itself
    assert twin.weight is conv.weight and twin.bias is conv.bias
    assert signature(twin).key != key
    assert conv.chunked and conv.mask_chunk(shape) == 1
    assert lean_module.mask_backward_per_sample(conv, True, shape)
    assert not twin.chunked and twin.mask_chunk(shape) == 3 and twin.mask_chunk((2, 16, 8, 8)) == 1
    assert not lean_module.mask_backward_per_sample(twin, True, shape)
    assert lean_module.mask_backward_per_sample(twin, True, (2, 16, 8, 8))  # another batch size
    choice[shape]["mask_chunk"] = 2
    assert twin.mask_chunk(shape) == 3  # the copy holds its own choices


@pytest.mark.parametrize("bisect", [True, False])
@pytest.mark.parametrize("fitting", [0, 1, 5, 9])
def test_the_last_fitting_candidate_is_chosen(bisect, fitting):
    setting = Setting("chunk", tuple(range(1, 11)), "forward", bisect=bisect)
    tried = []

    def fits(value):
        tried.append(value)
        return value <= setting.candidates[fitting]

    assert schedule_module._last_fitting(setting, fits) == setting.candidates[fitting]
    assert 1 not in tried  # the default is never measured: it is the peak's own
    if bisect:
        assert len(tried) <= 4  # log2(10)


def test_a_schedule_stored_before_settings_loads_and_applies():
    """The keys finetune has written into run folders: read, applied as each conv's execution,
    written back unchanged."""
    stored = {"batch_size": 4, "resolution": 64,
              "whole_batch_backward": {"features.3.conv.0.0": [4, 48, 16, 16]},
              "sample_by_sample_backward": ["features.4.conv.0.0"],
              "forward_mask_chunks": {"features.3.conv.1.0": {"shape": [4, 48, 16, 16], "chunk": 2}},
              "streamed_segments": [],
              "whole_weight_convs": ["features.18.0"]}
    schedule = Schedule.from_dict(json.loads(json.dumps(stored)))
    assert schedule.to_dict() == stored and not schedule.settings
    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=2))
    apply_schedule(net, schedule)
    convs = {n: m for n, m in net.named_modules() if isinstance(m, FrozenConvBNAct)}
    assert convs["features.3.conv.0.0"].execution == {(4, 48, 16, 16): {"backward": "whole_batch"}}
    assert convs["features.3.conv.1.0"].execution == {(4, 48, 16, 16): {"mask_chunk": 2}}
    assert convs["features.18.0"].execution == {None: {"weight": "whole"}}
    assert sum(bool(m.execution) for m in convs.values()) == 3
    apply_schedule(net, Schedule(4, 64))  # back to the defaults
    assert not any(m.execution for m in convs.values())


class Scratch(nn.Module):
    """A test leaf with one setting: a forward temporary of that many bytes (none by default)."""

    SIZES = (0, 1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28)

    def __init__(self):
        super().__init__()
        self.execution = {}

    def settings(self, call):
        return (Setting("scratch", self.SIZES, "forward"),)

    def configured(self, choice):
        twin = copy.copy(self)
        twin.execution = {k: dict(v) for k, v in choice.items()}
        return twin

    def forward(self, x):
        size = self.execution.get(tuple(x.shape), {}).get("scratch", 0)
        tmp = torch.empty(size, dtype=torch.uint8, device=x.device)
        del tmp
        return x.clone()


def test_any_tunable_leaf_is_fitted_stored_and_applied():
    """A layer memory/ knows nothing of: its largest scratch within the default peak is chosen
    (the next would raise the predicted step), stored under "settings", read back, applied."""
    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=2))
    scratch = Scratch()
    net.classifier[-1] = nn.Sequential(scratch, net.classifier[-1])
    default = runtime_report(net, mode="repnet", resolution=RES, batch_size=BATCH).total_bytes
    schedule = fit_schedule(net, resolution=RES, batch_size=BATCH)
    assert scratch.execution == {}
    (name, by_shape), = schedule.settings.items()
    (shape, chosen), = by_shape.items()
    assert name == "classifier.1.0" and chosen["scratch"] in Scratch.SIZES[1:-1]
    assert Schedule.from_dict(json.loads(json.dumps(schedule.to_dict()))) == schedule
    apply_schedule(net, schedule)
    assert scratch.execution == {shape: chosen}
    assert runtime_report(net, mode="repnet", resolution=RES, batch_size=BATCH).total_bytes <= default
    bigger = Scratch.SIZES[Scratch.SIZES.index(chosen["scratch"]) + 1]
    scratch.execution = {shape: {"scratch": bigger}}
    assert runtime_report(net, mode="repnet", resolution=RES, batch_size=BATCH).total_bytes > default


def test_the_schedule_imports_no_layer():
    """memory/schedule.py scores what layers declare; it names no lean layer or its helpers."""
    tree = ast.parse(Path(schedule_module.__file__).read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("edgetl.models.lean")], imported
