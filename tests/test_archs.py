"""Issue #42 item 1: backbones are data. The registry's MobileNetV2 entry builds torchvision's
network, and an architecture registered by a test (not from torchvision) gets the memory
model, the plan and a Rep-Net training step measured = predicted without touching memory/."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from edgetl.errors import ConfigError
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.models import archs
from edgetl.models.backbone import BackboneSpec, build_backbone, hidden_channels
from edgetl.models.side import LeanOptions, build_network, taps_of
from edgetl.profile import paper_report

RES, BATCH = 64, 4


def _cna(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU6())


def _tiny(spec) -> tuple[nn.Sequential, nn.Sequential]:
    """Five conv-BN-ReLU6 blocks (strides 2, 2, 1, 2, 1) and a linear head: no torchvision model."""
    widths = [round(c * spec.width) for c in (8, 16, 16, 32, 32)]
    features = nn.Sequential(*(_cna(cin, cout, s) for cin, cout, s in zip([3, *widths], widths, (2, 2, 1, 2, 1))))
    return features, nn.Sequential(nn.Dropout(spec.dropout), nn.Linear(widths[-1], spec.num_classes))


def _tiny_set_hidden(features: nn.Sequential, block: int, channels: int) -> None:
    """Block b's hidden channels are its conv's outputs, read by block b + 1's conv."""
    cin, stride = features[block][0].in_channels, features[block][0].stride[0]
    features[block] = _cna(cin, channels, stride)
    nxt = features[block + 1][0]
    features[block + 1] = _cna(channels, nxt.out_channels, nxt.stride[0])


TINY = archs.register(archs.Architecture(
    name="tiny_cna_test", title="TinyCNA", build=_tiny, prunable=range(1, 4),
    hidden=lambda block: (archs.Hidden(f"{block}.0", f"{block}"),), set_hidden=_tiny_set_hidden, taps=(1, 3),
))


def test_an_unknown_architecture_is_one_line_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"^unknown backbone arch 'resnet9'; allowed: mobilenet_v2, .*tiny_cna_test"):
        BackboneSpec(arch="resnet9")
    with pytest.raises(ConfigError, match="registered already"):
        archs.register(TINY)


def test_the_mobilenet_v2_entry_builds_torchvisions_network():
    """Against torchvision's own builder: the same parameters and buffers, name by name."""
    ours = build_backbone(BackboneSpec(width=0.35, num_classes=7)).state_dict()
    theirs = torchvision.models.mobilenet_v2(width_mult=0.35, num_classes=7).state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    net = build_backbone(BackboneSpec(width=1.0, hidden={1: 22, 2: 21}), device="meta")
    assert (hidden_channels(net, 1), hidden_channels(net, 2), hidden_channels(net, 3)) == (22, 21, 144)
    assert net.features[0][0].out_channels == 22 and net.features[2].conv[0][0].out_channels == 21


def test_a_registered_architecture_builds_prunes_and_refuses_what_it_lacks():
    net = build_backbone(BackboneSpec(arch="tiny_cna_test", width=1.0, num_classes=3, hidden={2: 5}))
    assert [b[0].out_channels for b in net.features] == [8, 16, 5, 32, 32]
    assert net.features[3][0].in_channels == 5 and hidden_channels(net, 2) == 5
    assert taps_of(net) == (1, 3)
    net(torch.randn(2, 3, RES, RES))  # the rebuilt network runs
    with pytest.raises(ConfigError, match=r"allowed blocks: 1..3"):
        BackboneSpec(arch="tiny_cna_test", hidden={4: 3})


@pytest.mark.parametrize("lean", [None, LeanOptions(pool=2)], ids=["stock", "lean"])
def test_a_registered_architecture_trains_as_predicted(lean):
    """The memory model was written for MobileNetV2, but measures what runs: a new
    architecture's Rep-Net step is predicted to the byte with no change to memory/."""
    torch.manual_seed(0)
    net = build_network(BackboneSpec(arch="tiny_cna_test", num_classes=3), "repnet", lean=lean)
    assert len(net.side.blocks) == 2
    if lean is not None:
        prepare_step(net, resolution=RES, batch_size=BATCH)
    report = runtime_report(net, mode="repnet", resolution=RES, batch_size=BATCH)
    assert report.total_bytes == measure_training_peak(net, resolution=RES, batch_size=BATCH, steps=2)
    paper = paper_report(build_network(BackboneSpec(arch="tiny_cna_test", num_classes=3), "repnet", device="meta"),
                         mode="repnet", resolution=RES, batch_size=BATCH)
    assert len(paper.blocks) == 6  # five feature blocks and the head


def test_plan_searches_a_registered_architecture():
    from edgetl.plan import plan, verify_plan

    spec = BackboneSpec(arch="tiny_cna_test", num_classes=3)
    result = plan(budget_bytes=2_000_000, batch_size=BATCH, resolution=RES, num_classes=3, backbone=spec,
                  stream=0)
    assert result.predicted_bytes <= 2_000_000 and set(result.chosen.kept) <= {1, 2, 3}
    assert verify_plan(result, steps=2) == result.predicted_bytes
