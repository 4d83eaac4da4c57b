"""Runtime accounting (DESIGN 2b) against the meter (2c) and against hand counts."""

import pytest
import torch
from torch import nn

from edgetl.cli import main
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.paper import sensitive
from edgetl.memory.report import MB
from edgetl.cost import LayerCost
from edgetl.memory.flow import trace_flow
from edgetl.memory.leaf import function_cost
from edgetl.memory.rules import layer_cost, stock_cost
from edgetl.memory.runtime import runtime_report
from edgetl.step import Step
from edgetl.models.backbone import BackboneSpec, EdgeNet
from edgetl.models.side import Resize, build_network
from edgetl.profile import profile

F4 = 4
RES = 16  # tiny nets: 16x16 maps
CH = 8


def tiny_net(layer: nn.Module, *, conv_trains: bool = True, classes: int = 3,
             out_channels: int = CH) -> EdgeNet:
    """image -> conv 3->8 (3x3) -> ``layer`` -> pool -> linear: one feature block."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, CH, 3, padding=1, bias=False)
    features = nn.Sequential(nn.Sequential(conv, layer))
    classifier = nn.Sequential(nn.Linear(out_channels, classes))
    net = EdgeNet(features, classifier, BackboneSpec(width=0.35, num_classes=classes))
    conv.requires_grad_(conv_trains)
    return net


class Upsample2(nn.Module):
    def __init__(self):
        super().__init__()
        self.resize = Resize()

    def forward(self, x):
        return self.resize(x, (2 * x.shape[-2], 2 * x.shape[-1]))


# layer -> bytes it keeps for backward per image, by hand (the conv before it trains, so
# the layer's output needs grad; the conv itself saves the image, which is static)
MAP = CH * RES * RES * F4
RULES = {
    "bn": (lambda: nn.BatchNorm2d(CH), MAP + 2 * CH * F4),  # input + save_mean/invstd
    "relu6_inplace": (lambda: nn.ReLU6(inplace=True), MAP),  # a clone of its input
    "relu6": (lambda: nn.ReLU6(), MAP),  # its input
    "relu_inplace": (lambda: nn.ReLU(inplace=True), MAP),  # its result = the conv output
    "avgpool": (lambda: nn.AvgPool2d(2), MAP),  # its input
    "dropout": (lambda: nn.Dropout(0.3), MAP),  # an fp32 mask
    "frozen_conv": (lambda: nn.Conv2d(CH, CH, 1, bias=False).requires_grad_(False), MAP),
    "resize": (lambda: Upsample2(), 0),
    "flatten_free": (lambda: nn.Identity(), 0),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_each_rule_against_hand_count_and_meter(name):
    make, stored = RULES[name]
    net = tiny_net(make())
    report = runtime_report(net, mode="full", resolution=RES, batch_size=2)
    # hand count: block 0 keeps exactly what the rule says; the head keeps the linear's input
    assert report.block(0).cugrd_bytes == stored
    assert report.block(len(net.features)).cugrd_bytes == stored + CH * F4
    measured = measure_training_peak(net, resolution=RES, batch_size=2, steps=2)
    assert report.total_bytes == measured


def test_stock_rules_table():
    kw = dict(in_shape=(1, CH, 4, 4), out_shape=(1, CH, 4, 4), act_bytes=4,
              input_requires_grad=True, output_requires_grad=True)
    assert stock_cost(nn.ReLU6(inplace=True), **kw) == LayerCost(inplace=True, saved_new_bytes=512)
    assert stock_cost(nn.ReLU(inplace=True), **kw) == LayerCost(inplace=True, saves_output=True)
    assert stock_cost(nn.AdaptiveAvgPool2d(1), **{**kw, "out_shape": (1, CH, 1, 1)}) == LayerCost()
    assert stock_cost(nn.Linear(4, 4).requires_grad_(False), **kw) == LayerCost(saves_input=False)
    no_grad = {**kw, "input_requires_grad": False, "output_requires_grad": False}
    assert stock_cost(nn.BatchNorm2d(CH), **no_grad) == LayerCost(forward_temp_bytes=2 * CH * 4)
    assert stock_cost(nn.Conv2d(CH, CH, 1), **no_grad) == LayerCost()


def test_frozen_first_layers_keep_nothing_and_temporaries_are_input_plus_output():
    """A frozen conv + BN + ReLU6 before anything trains: nothing kept, only temporaries."""
    net = tiny_net(nn.Sequential(nn.BatchNorm2d(CH).requires_grad_(False), nn.ReLU6(inplace=True)),
                   conv_trains=False)
    report = runtime_report(net, mode="last", resolution=RES, batch_size=2)
    assert report.block(0).cugrd_bytes == 0
    # the step fit runs (bn "fold"): the frozen BN is in eval mode, conv output and BN output live
    assert report.block(0).tmp_bytes == 2 * MAP
    assert report.total_bytes == measure_training_peak(net, resolution=RES, batch_size=2, steps=2)
    # bn "batch": batch statistics, allocated next to them
    batch = Step(bn="batch")
    report = runtime_report(net, mode="last", resolution=RES, batch_size=2, step=batch)
    assert report.block(0).tmp_bytes == 2 * MAP + 2 * CH * F4
    assert report.total_bytes == measure_training_peak(net, resolution=RES, batch_size=2, steps=2, step=batch)


class LeanFrozenConv(nn.Conv2d):
    """A frozen conv whose backward needs only the weight (DESIGN 4): keeps no activation."""

    def forward(self, x):
        return _InputGradOnly.apply(x, self.weight, self.padding)


class _InputGradOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, padding):
        ctx.shape, ctx.padding = x.shape, padding
        ctx.save_for_backward(weight)
        return nn.functional.conv2d(x, weight, padding=padding)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return torch.nn.grad.conv2d_input(ctx.shape, weight, grad, padding=ctx.padding), None, None


def test_a_layer_of_its_own_is_measured_not_taken_for_its_stock_base():
    """A subclass of nn.Conv2d with its own autograd Function: the accounting measures it on
    meta (it keeps no activation; conv2d_input's 1-element dummy is 4 B in backward) rather
    than applying the stock conv rule of its base class."""
    lean = LeanFrozenConv(CH, CH, 3, padding=1, bias=False).requires_grad_(False)
    cost = layer_cost(lean, in_shape=(2, CH, RES, RES), out_shape=(2, CH, RES, RES), act_bytes=F4, in_bytes=F4,
                      in_dtype=torch.float32, input_requires_grad=True, output_requires_grad=True)
    assert cost == LayerCost(backward_temp_bytes=4)
    net = tiny_net(lean)
    report = runtime_report(net, mode="full", resolution=RES, batch_size=2)
    assert report.block(0).cugrd_bytes == 0  # the stock rule would say MAP
    assert report.total_bytes == measure_training_peak(net, resolution=RES, batch_size=2, steps=2)
    stock = runtime_report(tiny_net(nn.Conv2d(CH, CH, 3, padding=1, bias=False).requires_grad_(False)),
                           mode="full", resolution=RES, batch_size=2)
    assert stock.block(0).cugrd_bytes == MAP


class HoldsALocal(nn.Module):
    """Reads its 4x map once, but its local variable keeps the map alive until it returns."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.act = Resize(), Resize(), nn.ReLU()

    def forward(self, x):
        big = self.up(x, (2 * x.shape[-2], 2 * x.shape[-1]))
        small = self.down(big, x.shape[-2:])
        return self.act(small)  # ``big`` is still bound here


def test_how_long_python_holds_a_tensor_is_seen_in_the_forward():
    """The trace sees a storage die where the code lets go of it: ``big`` lives through the
    ReLU (7 maps at once), not only until its last reader (a rule of thumb's 6)."""
    net = tiny_net(HoldsALocal())
    report = runtime_report(net, mode="full", resolution=RES, batch_size=2)
    assert report.total_bytes == measure_training_peak(net, resolution=RES, batch_size=2, steps=2)
    assert report.block(0).peak_bytes == 7 * MAP


class GatesAndJoins(nn.Module):
    """Functions no table describes, called between its layers: a squeeze-excite gate (a mean,
    a sigmoid, a broadcast multiply that keeps both its inputs), erf, and a concatenation of
    a list of tensors."""

    def __init__(self):
        super().__init__()
        self.squeeze = nn.Conv2d(2 * CH, CH, 1)

    def forward(self, x):
        gate = torch.sigmoid(x.mean((2, 3), keepdim=True))
        return self.squeeze(torch.cat([x * gate, torch.special.erf(x)], 1))


def test_functions_between_layers_are_measured_like_layers():
    """Each function call is measured on meta with its own arguments: the multiply keeps both
    its inputs and returns a new gradient for each (the gate's a reduction of it), the
    concatenation passes slices of its grad_output on. Block 0 keeps, per image, the conv's
    output (for the multiply and erf), the gate (sigmoid's output, the multiply's input) and
    the concatenation (the 1x1 conv's input), by hand; the whole step equals the meter's."""
    net = tiny_net(GatesAndJoins())
    report = runtime_report(net, mode="full", resolution=RES, batch_size=2)
    assert report.block(0).cugrd_bytes == MAP + CH * F4 + 2 * MAP
    assert report.total_bytes == measure_training_peak(net, resolution=RES, batch_size=2, steps=2)
    flow = trace_flow(net, RES, 2)
    costs = {op.func: function_cost(op.call, (True,) * len(op.inputs), True) for op in flow.ops if op.call}
    assert costs["mul"].inputs_kept == (True, True) and costs["mul"].inputs_passed == (False, False)
    assert costs["cat"].inputs_kept == (False, False) and costs["cat"].inputs_passed == (True, True)
    assert costs["sigmoid"].saves_output and costs["mean"].inputs_kept == (False,)
    assert costs["special_erf"].inputs_kept == (True,) and costs["special_erf"].saved_new_bytes == 0


def test_the_trace_sees_storages_die_without_the_garbage_collector():
    """A storage dies in the trace when its last reference goes, not when the garbage
    collector finds a reference cycle holding it (a self-calling closure in the trace's own
    code once did: 118 deaths moved): with the collector off the trace is the same."""
    import gc

    net = build_network(BackboneSpec(width=0.35, num_classes=10), "repnet", device="meta")
    on = trace_flow(net, 64, 2).holds
    gc.disable()
    try:
        off = trace_flow(net, 64, 2).holds
    finally:
        gc.enable()
    assert off == on


TINY = BackboneSpec(width=0.35, num_classes=10)


@pytest.mark.parametrize("mode", ["full", "last", "repnet", "repnet+bias", "bn+last"])
def test_tiny_backbone_prediction_matches_measured(mode):
    torch.manual_seed(0)
    net = build_network(TINY, mode)
    report = runtime_report(net, mode=mode, resolution=64, batch_size=2)
    measured = measure_training_peak(net, resolution=64, batch_size=2, steps=2)
    assert abs(report.total_bytes / measured - 1) < 0.05  # the contract
    assert abs(report.total_bytes - measured) <= 64  # what the model achieves today: exact


def test_report_fields_are_consistent():
    net = build_network(TINY, "repnet", device="meta")
    report = runtime_report(net, mode="repnet", resolution=64, batch_size=4)
    assert report.accounting == "runtime" and report.batch_size == 4
    assert sum(report.breakdown.values()) == report.total_bytes
    assert [b.index for b in report.blocks] == list(range(20))
    assert report.peak_activation_bytes == max(b.peak_bytes for b in report.blocks)
    assert report.sensitive_blocks == sensitive(report.blocks)
    cugrd = [b.cugrd_bytes for b in report.blocks]
    # before the first tap's side output joins (block 2), only the side module 0 keeps
    # anything; after it, every backbone layer keeps its input: cumulative, non-decreasing
    assert cugrd == sorted(cugrd) and cugrd[1] == 0 < cugrd[2]
    last = runtime_report(build_network(TINY, "last", device="meta"), mode="last", resolution=64,
                          batch_size=4)
    # last layer only: nothing kept until the head; the linear keeps its input (1 x C floats)
    assert all(b.cugrd_bytes == 0 for b in last.blocks[:-1])
    assert last.blocks[-1].cugrd_bytes == net.classifier[1].in_features * F4


@pytest.mark.parametrize("runtime,label", [("auto", "lean: pool 2 (stored per side module: 2 2 1 1 1 1), fp32 activations"), ("stock", "stock modules")])
def test_cli_runtime_measure(capsys, runtime, label):
    """repnet profiles the lean runtime by default (auto); --runtime stock the torch modules."""
    code = main(["profile", "--mode", "repnet", "--accounting", "runtime", "--measure", "--runtime", runtime,
                 "--width", "0.35", "--resolution", "64", "--num-classes", "10", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "prediction vs measured: +0.0%" in out or "prediction vs measured: -0.0%" in out
    assert "runtime accounting" in out and label in out


@pytest.mark.parametrize("runtime", ["auto", "stock"])
def test_profile_runtime_prediction_is_exact(runtime):
    report = profile(mode="repnet", accounting="runtime", resolution=64, batch_size=2, num_classes=10,
                     width=0.35, measure=True, measure_steps=2, runtime=runtime)
    assert report.runtime == ("lean" if runtime == "auto" else "stock")
    assert abs(report.total_bytes - report.measured_peak_bytes) <= 64


def test_full_size_repnet_matches_design_figure():
    """224 px, batch 8, 102 classes, stock modules (no ``lean``): DESIGN 2c measured 414.7 MB
    with every BN in train mode; the step fit runs keeps the frozen BNs in eval mode (their
    batch statistics are not computed): 414.6 MB."""
    net = build_network(BackboneSpec(num_classes=102), "repnet")
    report = runtime_report(net, mode="repnet", resolution=224, batch_size=8)
    measured = measure_training_peak(net, resolution=224, batch_size=8, steps=2)
    assert round(measured / MB, 1) == 414.6
    assert abs(report.total_bytes / measured - 1) < 0.05
