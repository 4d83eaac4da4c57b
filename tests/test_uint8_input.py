"""The batch as uint8 pixels (issue #14 item 2): the network normalises it, micro-batch by
micro-batch where its backbone streams, with the very values the float loaders gave, and the
accounting predicts the step's memory exactly."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from edgetl import data as D
from edgetl.errors import ConfigError
from edgetl.export import Preprocessing
from edgetl.memory.meter import measure_training_peak
from edgetl.memory.runtime import runtime_report
from edgetl.memory.schedule import prepare_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.lean import InputNorm
from edgetl.models.side import LeanOptions, build_network
from edgetl.models.stream import apply_streams, segments_of
from edgetl.step import Step, set_train_mode

RES, CLASSES = 64, 10
SPEC = BackboneSpec(width=0.35, num_classes=CLASSES)


def _images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (RES + 13, RES + 7, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_network_normalises_to_the_loaders_values_bit_for_bit(dtype):
    images = _images(3)
    floats = torch.stack([D.eval_transform(RES)(im) for im in images]).to(dtype)
    pixels = torch.stack([D.eval_transform(RES, uint8=True)(im) for im in images])
    assert pixels.dtype == torch.uint8 and pixels.shape == floats.shape
    assert torch.equal(InputNorm(out_dtype=dtype)(pixels), floats)
    # the deployed model's preprocessing (export metadata) names the same statistics
    spec = Preprocessing(resolution=RES)
    norm = InputNorm()
    assert torch.equal(norm.mean.flatten(), torch.tensor(spec.mean))
    assert torch.equal(norm.std.flatten(), torch.tensor(spec.std))


def _step(net, x, y):
    torch.manual_seed(1)
    set_train_mode(net, "fold")
    net.zero_grad(set_to_none=True)
    out = net(x)
    nn.functional.cross_entropy(out, y).backward()
    return out.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", ["repnet", "bias"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("m", [0, 1, 3])
def test_a_uint8_batch_trains_as_the_float_batch(mode, precision, m):
    """Same logits and gradients as the loaders' float batch, streamed (m) or not (0)."""
    torch.manual_seed(0)
    lean = dict(pool=2, precision=precision)
    plain = build_network(SPEC, mode, lean=LeanOptions(**lean))
    raw = build_network(SPEC, mode, lean=LeanOptions(**lean, uint8_input=True))
    raw.load_state_dict(plain.state_dict())
    assert raw.state_dict().keys() == plain.state_dict().keys()
    assert raw.input_dtype == torch.uint8
    pixels = torch.randint(0, 256, (5, 3, RES, RES), dtype=torch.uint8)
    floats = InputNorm(out_dtype=plain.input_dtype)(pixels)
    if m:
        taps = tuple(raw.side.taps) if raw.side is not None else ()
        segments = {a: (b, m) for a, b in segments_of(len(raw.features), taps)}
        apply_streams(raw, segments)
        apply_streams(plain, segments)
    y = torch.randint(0, CLASSES, (5,))
    out_a, grads_a = _step(plain, floats, y)
    out_b, grads_b = _step(raw, pixels, y)
    assert torch.equal(out_b, out_a)
    for name in grads_a:
        assert torch.equal(grads_b[name], grads_a[name]), name
    with torch.no_grad():  # a float batch (export, a caller's tensors) still passes through
        raw.eval()
        plain.eval()
        assert torch.equal(raw(floats), plain(floats))


@pytest.mark.parametrize("mode, batch, m, precision", [
    ("repnet", 4, 0, "fp32"), ("repnet", 4, 1, "bf16"), ("repnet", 5, 2, "fp32"), ("bias", 4, 1, "bf16"),
    ("bias", 5, 0, "bf16"),
])
@pytest.mark.parametrize("in_backward", [False, True])
def test_a_uint8_step_is_predicted_exactly(mode, batch, m, precision, in_backward):
    torch.manual_seed(0)
    net = build_network(SPEC, mode, lean=LeanOptions(pool=2, stream=m, precision=precision, uint8_input=True))
    step = Step.plain(step_in_backward=in_backward)
    prepare_step(net, resolution=RES, batch_size=batch, step=step)
    predicted = runtime_report(net, mode=mode, resolution=RES, batch_size=batch, step=step)
    measured = measure_training_peak(net, resolution=RES, batch_size=batch, steps=2, step=step)
    assert measured == predicted.total_bytes
    # the batch itself: one byte a value
    assert predicted.breakdown["input batch + labels"] == batch * 3 * RES * RES + batch * 8


def test_uint8_saves_the_batch_bytes_it_promises():
    torch.manual_seed(0)
    reports = {}
    for u8 in (False, True):
        net = build_network(SPEC, "repnet", device="meta",
                            lean=LeanOptions(pool=2, stream=1, precision="bf16", uint8_input=u8))
        prepare_step(net, resolution=RES, batch_size=8)
        reports[u8] = runtime_report(net, mode="repnet", resolution=RES, batch_size=8)
    a, b = reports[False].breakdown["input batch + labels"], reports[True].breakdown["input batch + labels"]
    assert a - b == 8 * 3 * RES * RES  # 2 bytes a value -> 1
    assert reports[True].total_bytes < reports[False].total_bytes


def test_uint8_input_is_refused_where_nothing_normalises(tmp_path):
    with pytest.raises(ConfigError, match="uint8 input is for a frozen lean backbone"):
        build_network(SPEC, "full", lean=LeanOptions(uint8_input=True))
    from edgetl.finetune import lean_options
    from edgetl.recipe import load_recipe

    recipe = load_recipe("imagefolder", overrides={"model.mode": "repnet", "model.runtime": "stock",
                                          "model.uint8_input": True})
    with pytest.raises(ConfigError, match=r"model.uint8_input True does not apply to mode repnet on stock modules: it needs the lean "
                                         r"runtime \(model.runtime lean"):
        lean_options(recipe)


def test_the_loaders_of_a_uint8_recipe_yield_pixels(tmp_path):
    from edgetl.recipe import load_recipe

    root = tmp_path / "data"
    for c in ("a", "b"):
        (root / "train" / c).mkdir(parents=True)
        (root / "val" / c).mkdir(parents=True)
        for i, im in enumerate(_images(2, seed=ord(c))):
            im.save(root / "train" / c / f"{i}.png")
            im.save(root / "val" / c / f"{i}.png")
    recipe = load_recipe("imagefolder", overrides={"model.mode": "repnet", "model.uint8_input": True,
                                          "data.preset": "imagefolder", "data.root": str(root),
                                          "data.resolution": RES})
    splits = D.datasets_from_recipe(recipe)
    x, _ = splits.val[0]
    assert x.dtype == torch.uint8 and x.shape == (3, RES, RES)
    plain = D.datasets_from_recipe(load_recipe("imagefolder", overrides={
        "model.mode": "repnet", "data.preset": "imagefolder", "data.root": str(root), "data.resolution": RES}))
    assert torch.equal(InputNorm()(x[None]), plain.val[0][0][None])


def test_a_copy_of_a_uint8_network_keeps_its_normalisation():
    net = build_network(SPEC, "repnet", lean=LeanOptions(pool=2, stream=1, uint8_input=True))
    twin = copy.deepcopy(net)
    pixels = torch.randint(0, 256, (2, 3, RES, RES), dtype=torch.uint8)
    net.eval()
    twin.eval()
    with torch.no_grad():
        assert torch.equal(twin(pixels), net(pixels))


def test_retrain_refuses_a_uint8_batch(tmp_path):
    from edgetl.recipe import load_recipe
    from edgetl.retrain import retrain

    recipe = load_recipe("fashion_mnist", {"model.mode": "full", "model.uint8_input": True})
    with pytest.raises(ConfigError, match="model.uint8_input is for finetune's lean runtime"):
        retrain(recipe=recipe, out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
