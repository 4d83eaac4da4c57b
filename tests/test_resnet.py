"""Issue #42: ResNet-18/34/50 as registry entries. Each is checked against torchvision's own
network (keys, function), against an independent walk of TinyTL's profiler rules on
torchvision's module tree, and through pruning and the Rep-Net side network."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from torch import nn

from edgetl.errors import ConfigError, DataError
from edgetl.memory.paper import paper_blocks
from edgetl.memory.trace import trace_network
from edgetl.models import archs
from edgetl.models.backbone import (
    BackboneSpec,
    backbone_spec,
    block_shapes,
    build_backbone,
    hidden_channels,
    open_backbone,
    weights_file,
    weights_names,
)
from edgetl.models.side import build_network, build_side_network, min_resolution, taps_of
from edgetl.profile import paper_report
from tests.test_resnet_pipeline import run_cli_output

DEPTHS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3), "resnet50": (3, 4, 6, 3)}


def _randomise_bn(net: nn.Module) -> None:
    """Non-trivial BN statistics, so a key mapped to the wrong BN shows in the output."""
    g = torch.Generator().manual_seed(1)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_a_torchvision_state_dict_maps_onto_the_entry_and_computes_the_same(name):
    torch.manual_seed(0)
    tv = getattr(torchvision.models, name)(num_classes=10).eval()
    _randomise_bn(tv)
    entry = archs.get(name)
    net = build_backbone(BackboneSpec(arch=name, num_classes=10)).eval()
    net.load_state_dict(entry.from_torchvision(tv.state_dict()))  # strict: every key, once
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(net(x), tv(x))
    with pytest.raises(DataError, match="not a torchvision ResNet key"):
        entry.from_torchvision({"features.0.0.weight": torch.zeros(1)})


def test_blocks_shapes_and_names():
    depths = DEPTHS["resnet18"]
    net = build_backbone(BackboneSpec(arch="resnet18"), device="meta")
    assert len(net.features) == 1 + sum(depths)
    assert block_shapes(net) == [(64, 4), (64, 4), (64, 4), (128, 8), (128, 8), (256, 16), (256, 16),
                                 (512, 32), (512, 32)]
    r50 = build_backbone(BackboneSpec(arch="resnet50"), device="meta")
    assert [c for c, _ in block_shapes(r50)][:5] == [64, 256, 256, 256, 512]
    entry = archs.get("resnet34")
    assert [entry.block_name(i) for i in (0, 1, 3, 4, 16)] == ["stem", "layer1.0", "layer1.2", "layer2.0", "layer4.2"]
    assert taps_of(net) == (0, 1, 3, 5, 7) and archs.get("resnet50").taps == (0, 1, 4, 8, 14)
    assert BackboneSpec(arch="resnet18").dropout == 0.0 and BackboneSpec().dropout == 0.2
    with pytest.raises(ConfigError, match="ResNet-18 has no width multiplier"):
        BackboneSpec(arch="resnet18", width=0.5)
    with pytest.raises(ConfigError, match=r"allowed blocks: 1..8"):
        BackboneSpec(arch="resnet18", hidden={9: 3})


def test_weights_names_of_every_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("EDGETL_OFFLINE", "1")
    assert {"resnet18:IMAGENET1K_V1", "resnet50:IMAGENET1K_V2", "resnet50:random"} <= set(weights_names())
    assert weights_file("resnet18").name == "resnet18-f37072fd.pth"  # a bare name: the entry's default
    assert weights_file("resnet50").name == weights_file("resnet50:IMAGENET1K_V2").name
    assert backbone_spec("resnet34:IMAGENET1K_V1").arch == "resnet34"
    with pytest.raises(DataError, match="EDGETL_OFFLINE forbids"):
        open_backbone("resnet18")
    with pytest.raises(ConfigError, match=r"unknown weights 'resnet18:IMAGENET9'; allowed: resnet18:IMAGENET1K_V1"):
        open_backbone("resnet18:IMAGENET9")
    a, info = open_backbone("resnet18:random", seed=3)
    b, _ = open_backbone("resnet18:random", seed=3)
    assert info["arch"] == "resnet18" and all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_a_torchvision_file_is_recognised_by_its_keys(tmp_path):
    torch.manual_seed(0)
    tv = torchvision.models.resnet34(num_classes=5)
    path = tmp_path / "mine.pth"
    torch.save(tv.state_dict(), path)
    net, info = open_backbone(path)
    assert info["arch"] == "resnet34" and net.spec.num_classes == 5
    assert torch.equal(net.features[4].conv1.weight, tv.layer2[0].conv1.weight)  # layer2.0 is block 4
    assert backbone_spec(path).arch == "resnet34"
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(DataError, match="is not the state_dict of a torchvision"):
        open_backbone(tmp_path / "other.pth")


# --- paper accounting, against TinyTL's profiler rules walked on torchvision's own module tree


def _tinytl_walk(tv: nn.Module, resolution: int) -> tuple[int, int]:
    """(per-image peak, stored) of full fine-tuning by TinyTL's rules (DESIGN 2a), walked on
    torchvision's ResNet with its own hooks: conv / linear store their input and hold input +
    output while they run; BN stores its input and holds it; ReLU stores a 1-bit mask and holds
    its input; max-pool and average pool are free; a BasicBlock / Bottleneck holds its input
    across its layers."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    state = {"stored": 0, "peak": 0, "held": 0}

    def numel(t):
        return t.numel()

    def leaf(module, args, out):
        nx, ny = numel(args[0]), numel(out)
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            temp, stored = (nx + ny // (module.groups if isinstance(module, nn.Conv2d) else 1)) * 4, nx * 4
        elif isinstance(module, nn.BatchNorm2d):
            temp, stored = nx * 4, nx * 4
        elif isinstance(module, nn.ReLU):
            temp, stored = nx * 4, nx // 8
        else:
            return
        state["peak"] = max(state["peak"], temp + state["stored"] + state["held"])
        state["stored"] += stored

    def enter(module, args):
        state["held"] = numel(args[0]) * 4

    def leave(module, args, out):
        state["held"] = 0

    for m in tv.modules():
        if isinstance(m, (BasicBlock, Bottleneck)):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)
        elif not list(m.children()):
            m.register_forward_hook(leaf)
    with torch.no_grad():
        tv(torch.zeros(1, 3, resolution, resolution, device="meta"))
    return state["peak"], state["stored"]


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_paper_accounting_equals_tinytls_rules_walked_on_torchvision(name):
    resolution = 224 if name == "resnet18" else 96
    with torch.device("meta"):
        tv = getattr(torchvision.models, name)(num_classes=102)
    peak, stored = _tinytl_walk(tv, resolution)
    net = build_network(BackboneSpec(arch=name, num_classes=102), "full", device="meta")
    report = paper_report(net, mode="full", resolution=resolution, batch_size=8)
    assert (report.peak_activation_bytes, report.stored_bytes) == (peak, stored)
    if name == "resnet18":  # the stem's conv: 3x224x224 in, 64x112x112 out, 4 B each
        assert report.block(0).tmp_bytes == (3 * 224 * 224 + 64 * 112 * 112) * 4


def test_the_resnet_trace_sees_every_relu_call_and_the_residual():
    trace = trace_network(build_network(BackboneSpec(arch="resnet18", num_classes=10), "full", device="meta"), 64)
    relus = [l for l in trace.leaves if l.kind == "relu" and l.block == 2]
    assert len(relus) == 2  # torchvision's BasicBlock calls its one ReLU twice
    assert [b.has_skip for b in trace.blocks][:3] == [False, True, True]
    assert [b.index for b in paper_blocks(trace)][-1] == 9  # the head is block len(features)


# --- the side network and pruning


def test_the_side_network_taps_the_stem_and_each_stage():
    def module(cin, cout, k, g):
        mid = -(-cin // 8) * 8
        return cin * mid * k * k // g + 2 * mid + mid * cout + 2 * cout

    net = build_backbone(BackboneSpec(arch="resnet18", num_classes=102), device="meta")
    side = build_side_network(net)
    expected = (module(3, 64, 5, 1) + module(64, 64, 5, 2) + module(64, 128, 5, 2) + module(128, 256, 5, 2)
                + module(256, 512, 3, 2))
    assert sum(p.numel() for p in side.parameters()) == expected == 782_440
    assert min_resolution(net) == 17  # the last module reads block 6 at stride 16: 2x2 at 17 px, 1x1 pooled
    torch.manual_seed(0)
    spec = BackboneSpec(arch="resnet18", num_classes=5)
    plain, with_side = build_backbone(spec).eval(), build_network(spec, "repnet").eval()
    with_side.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(plain(x), with_side(x))  # gamma 0: the untrained side adds nothing


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_pruning_a_resnet_block_keeps_the_residual_widths(name):
    from edgetl.prune import activation_l2_layers, key_convs, prune

    torch.manual_seed(0)
    net = build_backbone(BackboneSpec(arch=name, num_classes=10)).eval()
    blocks = [1, 4] if name == "resnet18" else [2, 5]
    calib = [torch.randn(4, 3, 64, 64)]
    result = prune(net=net, blocks=blocks, ratios=[0.5, 0.25], calib_batches=calib, resolution=64)
    # what torch-pruning changed: only the blocks' hidden layers (conv1, and conv2 in a Bottleneck)
    hidden = {f"features.{b}.{h}" for b in blocks for h in (("conv1", "conv2") if name == "resnet50" else ("conv1",))}
    assert {entry[0] for entry in result.history} == hidden and all(entry[1] for entry in result.history)
    for b, r in zip(blocks, (0.5, 0.25)):
        kept = int(hidden_channels(net, b) * (1 - r))
        assert [c.out_channels for c in key_convs(result.net, b)] == [kept] * (2 if name == "resnet50" else 1)
    assert result.spec.hidden == {b: int(hidden_channels(net, b) * (1 - r)) for b, r in zip(blocks, (0.5, 0.25))}
    # activation-L2 by hand: the block's conv1 -> bn1 -> ReLU output, read off a plain forward
    b = blocks[0]
    seen = {}
    block = net.features[b]
    h = block.bn1.register_forward_hook(lambda m, a, out: seen.setdefault("y", torch.relu(out)))
    with torch.no_grad():
        net.features[:b + 1](calib[0])
    h.remove()
    scores = activation_l2_layers(net, [b], calib)[b][0]
    assert torch.allclose(scores, seen["y"].double().pow(2).sum(dim=(0, 2, 3)).sqrt().float())
    kept_idx = scores.argsort(descending=True)[: result.kept[b]].sort().values
    assert torch.equal(result.net.features[b].conv1.weight, block.conv1.weight[kept_idx])
    out = result.net(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 10)


def test_the_resnet_stem_is_not_prunable_and_says_so():
    from edgetl.prune import check_plan

    with pytest.raises(ConfigError, match=r"block 0 cannot be pruned; allowed: 1..8 \(ResNet-18; block 0 has no hidden"):
        check_plan([0], [0.5], arch="resnet18")
    with pytest.raises(ConfigError, match=r"\(MobileNetV2; block 0 is pruned through block 1\)"):
        check_plan([0], [0.5])


# --- review findings: a ResNet through the paths that assumed MobileNetV2


def test_prune_refuses_a_plan_made_for_another_architecture(tmp_path, capsys):
    from edgetl.plan import plan

    result = plan(budget_bytes=18 * 10**6, batch_size=2, resolution=64, num_classes=3, stream=0, max_ratio=0.9,
                  backbone=BackboneSpec(arch="resnet18", num_classes=3))
    assert result.chosen.kept  # the plan prunes, so only the architecture can stop it
    result.save(tmp_path / "plan.yaml")
    code, out = run_cli_output(capsys, ["prune", "--plan", str(tmp_path / "plan.yaml"), "--importance", "weight-l2",
                              "-o", str(tmp_path / "out")])
    assert code == 2 and "planned for ResNet-18; this input is MobileNetV2" in out and not (tmp_path / "out").exists()


def test_a_plan_naming_a_block_its_resnet_lacks_is_one_line(tmp_path):
    from edgetl.plan import load_plan, plan

    result = plan(budget_bytes=18 * 10**6, batch_size=2, resolution=64, num_classes=3, stream=0, max_ratio=0.9,
                  backbone=BackboneSpec(arch="resnet18", num_classes=3))
    data = result.to_dict()
    b = data["prune"]["blocks"][0]
    for key in ("channels", "kept"):  # block 12 exists in MobileNetV2, not in ResNet-18
        data["prune"][key] = {(12 if int(k) == b else k): v for k, v in data["prune"][key].items()}
    data["prune"]["blocks"][0] = 12
    import yaml

    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError, match=r"block 12 is not a block the plan's backbone can prune; allowed: 1..8"):
        load_plan(tmp_path / "plan.yaml")


def test_a_recipe_width_on_a_resnet_is_one_line_naming_model_width():
    with pytest.raises(ConfigError, match=r"ResNet-18 has no width multiplier, and the width given is 0.35 .*model.width=1.0"):
        backbone_spec("resnet18", width=0.35)


def test_a_lean_resnet_block_still_holds_its_input_in_paper_accounting():
    from edgetl.models.lean.residual import LeanResidualBlock

    entry = archs.get("resnet18")
    lean = build_network(BackboneSpec(arch="resnet18", num_classes=3), "repnet", device="meta",
                         lean=__import__("edgetl.options", fromlist=["LeanOptions"]).LeanOptions(pool=1))
    blocks = [b for b in lean.features if isinstance(b, LeanResidualBlock)]
    assert len(blocks) == 8 and all(entry.has_skip(b) for b in blocks)


def test_retrain_starts_a_resnet_from_a_torchvision_file(tmp_path, capsys):
    from tests.conftest import make_color_folder

    torch.manual_seed(0)
    tv = torchvision.models.resnet18(num_classes=3)
    torch.save(tv.state_dict(), tmp_path / "r18.pth")
    data = make_color_folder(tmp_path / "data", n_train=4, n_val=2, size=32)
    code, out = run_cli_output(capsys, ["retrain", "--backbone", "resnet18", "--weights", str(tmp_path / "r18.pth"), "--data",
                              str(data), "--no-distill", "--epochs", "1", "--batch-size", "4", "--set",
                              "data.preset=imagefolder", "--set", "data.resolution=32", "--set", "train.workers=0",
                              "--set", "optim.warmup_epochs=0", "-o", str(tmp_path / "run")])
    assert code == 0, out
    spec = json.loads((tmp_path / "run" / "backbone.json").read_text())
    assert spec["spec"]["arch"] == "resnet18"
    code, out = run_cli_output(capsys, ["retrain", "--backbone", "resnet34", "--weights", str(tmp_path / "r18.pth"), "--data",
                              str(data), "--no-distill", "--epochs", "1", "-o", str(tmp_path / "run2")])
    assert code == 2 and "holds a resnet18 state_dict, not resnet34" in out
