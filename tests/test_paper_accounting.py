"""Paper accounting (DESIGN 2a): each rule by hand, then the papers' reference figures."""

import pytest
import torch
from torch import nn

from edgetl.memory.paper import leaf_bytes, paper_blocks, param_bytes, sensitive
from edgetl.memory.trace import Leaf, trace_network
from edgetl.models.backbone import BackboneSpec, build_backbone
from edgetl.models.side import build_network, build_side_network
from edgetl.profile import paper_report

MB = 1e6


def leaf(kind, in_shape, out_shape, groups=1, trainable=False):
    return Leaf("x", kind, 0, "backbone", in_shape, out_shape, groups=groups, weight_trainable=trainable)


@pytest.mark.parametrize(
    "kind, shapes, groups, trainable, backward, expected",
    [
        # conv: stored nx*4 if trainable, temp nx*4 + ny*4/groups
        ("conv", ((1, 16, 10, 10), (1, 96, 10, 10)), 1, True, True, (1600 * 4, 1600 * 4 + 9600 * 4)),
        ("conv", ((1, 16, 10, 10), (1, 96, 10, 10)), 1, False, True, (0, 1600 * 4 + 9600 * 4)),
        ("conv", ((1, 96, 10, 10), (1, 96, 5, 5)), 96, False, True, (0, 9600 * 4 + 2400 * 4 // 96)),
        ("linear", ((1, 1280), (1, 102)), 1, True, True, (1280 * 4, (1280 + 102) * 4)),
        ("linear", ((1, 1280), (1, 102)), 1, False, True, (0, (1280 + 102) * 4)),
        ("bn", ((1, 8, 4, 4), (1, 8, 4, 4)), 1, True, True, (128 * 4, 128 * 4)),
        ("bn", ((1, 8, 4, 4), (1, 8, 4, 4)), 1, False, True, (0, 128 * 4)),
        ("relu", ((1, 8, 4, 4), (1, 8, 4, 4)), 1, False, True, (128 // 8, 128 * 4)),
        ("relu", ((1, 8, 4, 4), (1, 8, 4, 4)), 1, False, False, (0, 128 * 4)),
        ("smooth_act", ((1, 8, 4, 4), (1, 8, 4, 4)), 1, False, True, (128 * 4, 128 * 4)),
        ("free", ((1, 8, 4, 4), (1, 8, 2, 2)), 1, False, True, (0, 0)),
    ],
)
def test_leaf_rules_by_hand(kind, shapes, groups, trainable, backward, expected):
    assert leaf_bytes(leaf(kind, *shapes, groups=groups, trainable=trainable), backward) == expected


def test_trace_classifies_leaves_and_order():
    net = build_network(BackboneSpec(width=0.35, num_classes=10), "repnet", device="meta")
    trace = trace_network(net, 64)
    kinds = {(type(l.module).__name__, l.kind) for l in trace.leaves}
    assert ("Conv2d", "conv") in kinds and ("ReLU6", "relu") in kinds
    assert ("BatchNorm2d", "bn") in kinds and ("Linear", "linear") in kinds
    assert ("AvgPool2d", "free") in kinds and ("Dropout", "free") in kinds
    # side module j runs right after tap block j, before the next block
    order = [(l.block, l.part) for l in trace.leaves]
    first_side = order.index((2, "side"))
    assert order[first_side - 1] == (2, "backbone") and order[first_side + 9] == (3, "backbone")
    # only the side network and classifier train in repnet mode
    assert all(l.weight_trainable == (l.part == "side" or l.block == 19)
               for l in trace.leaves if l.kind in ("conv", "linear"))


def test_walk_on_tiny_net_matches_hand_walk():
    """Re-walk the rules by hand for a 3-leaf chain: stem conv (trainable) -> BN -> ReLU6."""
    net = build_backbone(BackboneSpec(width=0.35, num_classes=4), device="meta")
    for p in net.parameters():
        p.requires_grad_(False)
    net.features[0][0].weight.requires_grad_(True)
    trace = trace_network(net, 32)
    stem = paper_blocks(trace)[0]
    nx, ny = 3 * 32 * 32, 16 * 16 * 16  # width 0.35 stem has 16 channels at stride 2
    assert trace.leaves[0].out_shape == (1, 16, 16, 16)
    s_conv = nx * 4
    tmp = max(nx * 4 + ny * 4, ny * 4, ny * 4)
    assert stem.tmp_bytes == tmp
    assert stem.cugrd_bytes == s_conv + ny // 8  # conv input + ReLU6 mask; frozen BN stores nothing
    assert stem.peak_bytes == max(nx * 4 + ny * 4, ny * 4 + s_conv, ny * 4 + s_conv)


def test_residual_input_is_held():
    """A skip block's peak includes its input (R) on top of temp + stored."""
    net = build_backbone(BackboneSpec(num_classes=10), device="meta")
    for p in net.parameters():
        p.requires_grad_(False)
    net.classifier[1].weight.requires_grad_(True)
    trace = trace_network(net, 224)
    blocks = {b.index: b for b in paper_blocks(trace)}
    # features[3]: 56x56x24 -> expand 144 -> dw 144 -> project 24, with a skip
    nx, hidden = 24 * 56 * 56, 144 * 56 * 56
    expand_tmp = (nx + hidden) * 4
    s_before = blocks[2].cugrd_bytes
    assert blocks[3].tmp_bytes == expand_tmp
    # the peak is at the project conv (same temp as the expand conv), after both ReLU6 masks
    project = expand_tmp + s_before + 2 * hidden // 8
    assert blocks[3].peak_bytes == project + nx * 4


def test_side_network_parameter_count():
    net = build_backbone(BackboneSpec(num_classes=102), device="meta")
    side = build_side_network(net)
    def module(cin, cout, k, g):
        mid = -(-cin // 8) * 8
        return cin * mid * k * k // g + 2 * mid + mid * cout + 2 * cout
    expected = module(3, 24, 5, 1) + module(24, 32, 5, 2) + module(32, 64, 5, 2) + \
        module(64, 96, 5, 2) + module(96, 160, 5, 2) + module(160, 320, 3, 2)
    assert sum(p.numel() for p in side.parameters()) == expected == 380_072


def test_untrained_side_network_equals_backbone():
    torch.manual_seed(0)
    spec = BackboneSpec(width=0.35, num_classes=5)
    plain = build_backbone(spec).eval()
    with_side = build_network(spec, "repnet").eval()
    with_side.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(plain(x), with_side(x))


def repnet_report(hidden=None):
    net = build_network(BackboneSpec(num_classes=102, hidden=hidden or {}), "repnet", device="meta")
    return paper_report(net, mode="repnet", resolution=224, batch_size=8)


def test_repnet_paper_figure_1():
    r = repnet_report()
    # block 2 expand conv: 16x112x112 in, 96x112x112 out, 4 B each (the paper's "5.6 MB")
    assert r.block(2).tmp_bytes == (16 + 96) * 112 * 112 * 4
    assert round(r.block(2).tmp_bytes / MB, 2) == 5.62
    # peak = that temporary + the 1-bit ReLU6 masks of blocks 0 and 1 (32x112x112 each)
    assert r.peak_activation_bytes == (16 + 96) * 112 * 112 * 4 + 2 * 32 * 112 * 112 // 8
    assert round(r.peak_activation_bytes / MB, 2) == 5.72
    assert round(r.stored_bytes / MB, 3) == 1.533
    assert round(r.param_bytes / MB, 2) == 4.27
    assert 50.0 <= r.total_bytes / MB <= 51.1
    assert {1, 2, 3, 4} <= set(r.sensitive_blocks)


def test_param_bytes_by_hand():
    net = build_network(BackboneSpec(num_classes=102), "repnet", device="meta")
    trace = trace_network(net, 224)
    trainable = 380_072 + 1280 * 102 + 102
    frozen = sum(p.numel() for p in net.features.parameters())
    assert (trace.trainable_params, trace.frozen_params) == (trainable, frozen)
    assert param_bytes(trace, frozen_bits=8) == trainable * 4 + frozen
    assert param_bytes(trace, frozen_bits=32) == (trainable + frozen) * 4


def test_full_finetune_matches_tinytl():
    net = build_network(BackboneSpec(num_classes=102), "full", device="meta")
    r = paper_report(net, mode="full", resolution=224, batch_size=8)
    assert r.total_bytes / MB == pytest.approx(447.7, rel=0.005)


def test_pruned_repnet_paper_figures():
    base, pruned = repnet_report(), repnet_report({1: 22, 2: 21, 3: 77, 4: 77})
    assert round(pruned.peak_activation_bytes / MB, 2) == 1.98
    assert round(pruned.total_bytes / MB, 1) == 20.1
    assert pruned.peak_activation_bytes <= 0.40 * base.peak_activation_bytes
    assert pruned.total_bytes <= 0.45 * base.total_bytes


def test_sensitive_definition():
    r = repnet_report()
    overall = r.blocks[-1].cugrd_bytes
    assert r.sensitive_blocks == [b.index for b in r.blocks if b.tmp_bytes > overall]
    assert sensitive(r.blocks) == r.sensitive_blocks


def test_frozen_conv_with_trainable_layer_after_stores_nothing_for_itself():
    """Paper rule: a frozen conv stores nothing even when gradients flow through it."""
    net = build_network(BackboneSpec(num_classes=10), "last", device="meta")
    trace = trace_network(net, 224)
    stored = [leaf_bytes(l, True)[0] for l in trace.leaves if l.kind == "conv"]
    assert stored == [0] * len(stored)
    assert isinstance(trace.leaves[0].module, nn.Conv2d)
