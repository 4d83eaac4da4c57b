"""Lean full fine-tuning (issue #16 item 2): BN folded, every conv trains, conv inputs kept by a storage."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from edgetl.cli import main
from edgetl.errors import ConfigError
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.models.backbone import BackboneSpec
from edgetl.models.compress import CompressedConv2d
from edgetl.models.lean import LeanMaxPool2d, LeanReLU, PooledConv2d
from edgetl.options import STORAGES
from edgetl.models.lean_full import full_state_dict, leanify_full
from edgetl.models.side import LeanOptions, build_network, make_lean

from tests.conftest import FMNIST_REASON, HAVE_FMNIST

SPEC = BackboneSpec(width=0.35, num_classes=10)


def calibrated(spec=SPEC, seed=0) -> nn.Module:
    """A stock mode-full network with non-trivial BN statistics, in eval mode."""
    torch.manual_seed(seed)
    net = build_network(spec, "full")
    net.train()
    with torch.no_grad():
        for _ in range(2):
            net(torch.randn(8, 3, 64, 64) * 2 + 0.5)
    return net.eval()


def on_torch_leaves(net: nn.Module) -> nn.Module:
    """A copy of a lean full network on torch's own leaves (nn.Conv2d with bias, nn.ReLU /
    nn.ReLU6, nn.MaxPool2d): the exact reference of its forward and of every gradient."""
    ref = copy.deepcopy(net)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PooledConv2d):
                conv = nn.Conv2d(child.in_channels, child.out_channels, child.kernel_size, stride=child.stride,
                                 padding=child.padding, groups=child.groups)
                conv.load_state_dict(child.state_dict())
                setattr(parent, name, conv)
            elif isinstance(child, LeanReLU):
                setattr(parent, name, nn.ReLU() if child.upper is None else nn.ReLU6())
            elif isinstance(child, LeanMaxPool2d):
                setattr(parent, name, nn.MaxPool2d(child.kernel_size, child.stride, child.padding))
    ref.pool = nn.AdaptiveAvgPool2d(1)
    return ref


def folded_reference(stock: nn.Module) -> nn.Module:
    """The BN-folded network on plain torch modules: what every storage's forward and input
    gradients must equal, and exact storage's weight gradients too."""
    return on_torch_leaves(leanify_full(copy.deepcopy(stock), storage="exact"))


def grads(net, x, y):
    torch.manual_seed(0)  # the classifier's dropout draws the same mask for every network
    net.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    nn.functional.cross_entropy(net(x), y).backward()
    out = {n: p.grad.clone() for n, p in net.named_parameters()}
    out["input"] = x.grad.clone()
    return out


@pytest.mark.parametrize("storage", STORAGES)
def test_runtime_accounting_equals_the_meter_for_every_storage(storage):
    """Predicted peak = measured peak, to the byte, for each storage; 48 px keeps odd map sides
    (3x3 after stride 16) next to the pooled and compressed ones."""
    for resolution, batch in ((64, 4), (48, 3)):
        net = calibrated()
        make_lean(net, LeanOptions(storage=storage, keep=0.25))
        predicted = runtime_report(net, mode="full", resolution=resolution, batch_size=batch).total_bytes
        measured = measure_training_peak(net, resolution=resolution, batch_size=batch, steps=2)
        assert predicted == measured, (storage, resolution, batch)


def test_storages_order_by_memory_and_each_keeps_what_it_says():
    """exact > pool2 > pool4 at 224 px (meta accounting): the stored conv inputs shrink by the
    pool factor squared where maps are large enough to pool (the 1-bit masks and the 7x7 maps
    stay), and threshold keeping 10 % stores 10 % of the values with 1-2 byte positions."""
    spec = BackboneSpec(width=1.0, num_classes=102)
    stored = {}
    for storage in ("exact", "pool2", "pool4", "threshold"):
        net = build_network(spec, "full", device="meta")
        make_lean(net, LeanOptions(storage=storage, keep=0.1))
        report = runtime_report(net, mode="full", resolution=224, batch_size=8)
        stored[storage] = report.stored_bytes  # kept for backward when forward ends
    assert stored["exact"] > stored["pool2"] > stored["pool4"]
    assert stored["exact"] / stored["pool2"] > 3
    assert stored["pool2"] / stored["pool4"] > 1.5
    assert stored["threshold"] < stored["exact"] / 5


@pytest.mark.parametrize("storage", STORAGES)
def test_forward_and_input_gradients_exact_only_weight_gradients_approximate(storage):
    stock = calibrated()
    ref = folded_reference(stock)
    lean = copy.deepcopy(stock)
    make_lean(lean, LeanOptions(storage=storage, keep=0.25))
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    with torch.no_grad():
        torch.testing.assert_close(lean.eval()(x), ref.eval()(x))
        torch.testing.assert_close(lean(x), stock(x), atol=1e-4, rtol=1e-4)  # BN folding: rounding only
    g_lean, g_ref = grads(lean.train(), x, y), grads(ref.train(), x, y)
    assert g_lean.keys() == g_ref.keys()
    for name, g in g_ref.items():
        approximate = storage != "exact" and name.startswith("features.") and name.endswith(".weight")
        if approximate:
            cos = nn.functional.cosine_similarity(g_lean[name].flatten(), g.flatten(), dim=0)
            assert cos > 0.0, (storage, name, cos)  # an approximation, not noise...
        else:
            torch.testing.assert_close(g_lean[name], g, rtol=1e-4, atol=1e-6, msg=f"{storage} {name}")
    if storage in ("pool2", "pool4"):
        convs = [m for m in lean.modules() if isinstance(m, PooledConv2d)]
        assert {m.pool for m in convs} == {int(storage[-1])}
    elif storage != "exact":
        assert all(isinstance(m, CompressedConv2d) for m in lean.features.modules() if isinstance(m, nn.Conv2d))


def test_weight_gradient_cosine_rises_with_what_is_kept():
    """Mean cosine of the conv weight gradients against exact storage (same kernels; layers
    whose gradient is float noise in this random network left out): keeping everything is
    exact, keeping half beats keeping a tenth, and a wavelet beats raw thresholding at a
    tenth (Vu et al.: transformed maps concentrate their energy in few coefficients)."""
    stock = calibrated()
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def weight_grads(storage, keep=0.1):
        lean = copy.deepcopy(stock)
        make_lean(lean, LeanOptions(storage=storage, keep=keep))
        return grads(lean.train(), x, y)

    exact = weight_grads("exact")
    names = [n for n, g in exact.items() if n.startswith("features.") and n.endswith(".weight")
             and g.abs().max() > 1e-7]
    assert len(names) > 20

    def mean_cos(storage, keep=0.1):
        g = weight_grads(storage, keep)
        return sum(nn.functional.cosine_similarity(g[n].flatten(), exact[n].flatten(), dim=0).item()
                   for n in names) / len(names)

    assert mean_cos("haar", 1.0) == pytest.approx(1.0, abs=1e-6)
    assert mean_cos("haar", 0.5) > mean_cos("haar", 0.1) > mean_cos("threshold", 0.1)
    assert mean_cos("pool2") > 0.99  # the 64 px maps that pool carry little of this gradient


def test_full_state_dict_rebuilds_the_trained_network_in_the_stock_layout():
    stock = calibrated()
    lean = copy.deepcopy(stock)
    make_lean(lean, LeanOptions(storage="pool2"))
    with torch.no_grad():
        for p in lean.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    back = build_network(SPEC, "full")
    back.load_state_dict(full_state_dict(lean, stock))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x), lean.eval()(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options, needle", [
    (dict(storage="pool3"), "storage: 'pool3' is not allowed; allowed: exact, pool2"),
    (dict(storage="haar", keep=0.0), "allowed: a fraction in (0, 1]"),
    (dict(storage="dct", keep=1.5), "allowed: a fraction in (0, 1]"),
])
def test_bad_storage_or_fraction_is_a_one_line_config_error(options, needle):
    with pytest.raises(ConfigError) as err:
        LeanOptions(**options)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mode, options, needle", [
    ("full", dict(precision="bf16"), "precision bf16 is not allowed with lean full fine-tuning"),
    ("full", dict(stream=1), "stream 1 is not allowed with lean full fine-tuning"),
    ("full", dict(frozen_weights="int8"), "frozen_weights int8 is not allowed"),
    ("repnet", dict(storage="pool2"), "storage pool2 applies to mode full"),
])
def test_options_a_mode_cannot_run_are_refused(mode, options, needle):
    net = build_network(SPEC, mode, device="meta")
    with pytest.raises(ConfigError, match=needle):
        make_lean(net, LeanOptions(**options))


def exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("args, needle", [
    (["--storage", "wavelet"], "invalid choice: 'wavelet'"),
    (["--storage", "haar", "--keep", "0"], "0.0 is not allowed; allowed: a fraction in (0, 1]"),
    (["--mode", "bn+last", "--runtime", "lean"], "the lean runtime allows"),
    (["--mode", "full", "--runtime", "lean", "--precision", "bf16"], "precision bf16 is not allowed"),
])
def test_profile_cli_bad_input_exit_2_one_line(args, needle, capsys):
    argv = ["profile", "--accounting", "runtime", "--resolution", "64", "--width", "0.35",
            "--mode", "full", "--runtime", "lean", *args]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1], err


def test_profile_cli_lean_full_prints_prediction_equal_to_measurement(capsys):
    argv = ["profile", "--accounting", "runtime", "--resolution", "64", "--width", "0.35", "--batch-size", "4",
            "--num-classes", "10", "--mode", "full", "--runtime", "lean", "--storage", "pool2", "--measure"]
    assert exit_code(argv) in (0, None)
    out = capsys.readouterr().out
    assert "prediction vs measured: +0.0%" in out


@pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)
def test_finetune_lean_full_run_folder_exports_the_network_that_trained(calibrated_backbone, tmp_path):
    """finetune --mode full --runtime lean --storage pool2: pre-flight = measured, and model.pt
    (stock layout) gives the lean network's logits."""
    from edgetl.export import load_run_model
    from edgetl.finetune import build_model, finetune
    from edgetl.recipe import load_recipe
    from edgetl.train import load_checkpoint

    recipe = load_recipe("fashion_mnist", {
        "model.backbone": str(calibrated_backbone), "data.max_samples": 64, "data.max_val_samples": 32,
        "train.epochs": 1, "model.mode": "full", "model.runtime": "lean", "model.storage": "pool2",
        "optim.lr_side": None})
    run = finetune(recipe=recipe, out_dir=tmp_path / "run")
    assert run.measured_peak_bytes == run.predicted.total_bytes
    info = json.loads((tmp_path / "run" / "model.json").read_text())
    assert info["lean"]["storage"] == "pool2" and info["mode"] == "full"
    exported = load_run_model(tmp_path / "run").net.eval()
    lean = build_model(recipe, 5)
    make_lean(lean, LeanOptions(storage="pool2"))
    lean.load_state_dict(load_checkpoint(tmp_path / "run" / "best.pt")["model"])
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(exported(x), lean.eval()(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("args, needle", [
    (["--storage", "pool3"], "invalid choice: 'pool3'"),
    (["--keep", "1.5"], "1.5 is not allowed; allowed: a fraction in (0, 1]"),
    (["--set", "model.keep=0"], "model.keep: 0.0 is not allowed; allowed: a fraction in (0, 1]"),
    (["--runtime", "stock", "--storage", "pool2"], "model.storage pool2 does not apply to mode full on stock modules"),
    (["--mode", "bn+last", "--runtime", "lean"], "the lean runtime allows"),
])
def test_finetune_cli_bad_storage_input_exit_2_no_run_folder(args, needle, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["finetune", "--recipe", "fashion_mnist", "--backbone", "mobilenet_v2:random", "--mode", "full",
            "-o", str(out), *args]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()
