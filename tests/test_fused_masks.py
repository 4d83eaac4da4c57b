"""Fused mask kernels (LeanOptions.mask_kernels "fused", edgetl.models.lean.fused) against
torch's own ops: the same values bit for bit, kernel by kernel and over whole training steps;
the memory the accounting predicts with them against the meter; their op counts on meta
against the meter's on a real step."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from edgetl.errors import CapabilityError, ConfigError
from edgetl.memory.meter import count_step_ops, measure_training_memory
from edgetl.memory.schedule import predict_step
from edgetl.models.backbone import BackboneSpec
from edgetl.models.lean import fused, set_mask_kernels
from edgetl.models.lean.frozen import _act_mask

from edgetl.models.lean.masks import unpack_as, unpack_table
from edgetl.models.side import LeanOptions, build_network
from edgetl.step import Step, training_step

TINY = BackboneSpec(width=0.35, num_classes=10)
SPECIAL = [0.0, -0.0, 6.0, float("nan"), float("inf"), float("-inf"), 5.999, 6.001, 1e-30, -1e-30]


pytestmark = pytest.mark.skipif(not fused.buildable(), reason=f"building the fused mask kernels needs {fused.missing()}, "
                                "not found here; edgetl refuses mask_kernels fused here in one line")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    fused.load()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


# torch's fp32 clamp on an Arm CPU (torch 2.5.1, the Jetson stack's, under emulation) turns -0.0
# into +0.0 in its vectorised body (NEON's max) and keeps it in the last elements its scalar
# loop clamps: there a zero's sign depends on where it lies, and the fused kernels, which keep
# -0.0 as torch's x86 kernels and its scalar loop do, are compared with zeros of either sign
ZERO_SIGN_COMPARED = platform.machine() not in ("aarch64", "arm64")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, a NaN's payload aside (torch's clamp and multiply may turn one NaN into
    another): NaN at the same places, every other value's bits equal (on an Arm CPU a zero's
    sign aside, ``ZERO_SIGN_COMPARED``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    if not ZERO_SIGN_COMPARED:
        zero = a == 0
        if not torch.equal(zero, b == 0):
            return False
        nan = nan | zero
    return torch.equal(_bits(a.masked_fill(nan, 0)), _bits(b.masked_fill(nan, 0)))


def _activation(shape, dtype, channels_last, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).mul_(4)
    flat = x.view(-1)
    flat[: len(SPECIAL)] = torch.tensor(SPECIAL)
    x = x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 16, 8, 8), (3, 24, 33, 17)])
@pytest.mark.parametrize("upper", [6.0, None])
def test_clamp_pack_gives_the_aten_path_s_values_and_mask(dtype, channels_last, shape, upper):
    y = _activation(shape, dtype, channels_last)
    want = y.clone()
    want.clamp_(0, upper) if upper is not None else want.clamp_(min=0)
    want_packed = _act_mask(want, 1, upper)
    packed = fused.clamp_pack_(y, upper)
    assert _same(y, want) and y.stride() == want.stride()
    assert packed.dtype == torch.uint8 and packed.shape == want_packed.shape
    assert torch.equal(packed, want_packed)
    # an independent reading of the bits: element i of the memory order is bit i % 8 of byte i // 8
    order = want.permute(0, 2, 3, 1).reshape(-1) if channels_last else want.reshape(-1)
    inside = (order != 0) & ~(order == upper if upper is not None else torch.zeros_like(order, dtype=torch.bool))
    bits = (packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
    assert torch.equal(bits.reshape(-1)[: order.numel()].bool(), inside)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("grad_layout", ["same", "other"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 16, 8, 8), (1, 24, 1, 1)])
def test_mask_mul_gives_the_aten_path_s_gradient_and_layout(dtype, channels_last, grad_layout, shape):
    y = _activation(shape, dtype, channels_last)
    packed = fused.clamp_pack_(y, 6.0)
    gy = _activation(shape, dtype, channels_last if grad_layout == "same" else not channels_last, seed=1)
    want = unpack_as(packed, shape, unpack_table(dtype, "cpu"), channels_last).mul_(gy)
    got = fused.mask_mul(gy, packed, channels_last)
    assert got.dtype == dtype and got.stride() == want.stride()
    assert _same(got, want)  # NaN and inf grads times 0 included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_portable_loop_an_arm_cpu_runs_gives_the_same_values(dtype):
    """The build without AVX2 (``fused.BUILDS["edgetl_portable"]``), as a Jetson's Arm cores run
    it, against torch's path: whole bytes and a partial one, both layouts, ReLU6 and ReLU."""
    fused.load("edgetl_portable")
    ops = torch.ops.edgetl_portable
    for shape, channels_last, upper in (((3, 24, 33, 17), True, 6.0), ((2, 3, 5, 7), False, None)):
        y = _activation(shape, dtype, channels_last)
        want = y.clone()
        want.clamp_(0, upper) if upper is not None else want.clamp_(min=0)
        packed = ops.clamp_pack_(y, upper)
        assert _same(y, want) and torch.equal(packed, _act_mask(want, 1, upper))
        gy = _activation(shape, dtype, channels_last, seed=1)
        got = ops.mask_mul(gy, packed, channels_last)
        assert _same(got, unpack_as(packed, shape, unpack_table(dtype, "cpu"), channels_last).mul_(gy))


def test_the_meta_kernels_give_the_aten_path_s_layouts():
    """What the accounting measures a fused layer with: the meta kernels' results laid out as
    torch's path lays out its packed mask and its masked gradient (the gradient in either layout)."""
    for channels_last in (False, True):
        y = _activation((2, 16, 5, 5), torch.float32, channels_last).clamp_(0, 6)
        packed = _act_mask(y, 1, 6.0)
        meta = torch.empty_like(y, device="meta")
        packed_meta = fused.clamp_pack_(meta, 6.0)
        assert (packed_meta.shape, packed_meta.dtype) == (packed.shape, packed.dtype)
        for layout in (channels_last, not channels_last):
            gy = _activation((2, 16, 5, 5), torch.float32, layout, seed=1)
            want = unpack_as(packed, gy.shape, unpack_table(gy.dtype, "cpu"), channels_last).mul_(gy)
            got = fused.mask_mul(torch.empty_like(gy, device="meta"), packed_meta, channels_last)
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)


def test_many_threads_and_a_partial_last_byte_give_the_same_bytes():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (1_000_003, 262_147):
            y = torch.randn(n, generator=torch.Generator().manual_seed(n)).mul_(4)
            y[:: 997] = 6.0
            want = y.clone().clamp_(0, 6)
            packed = fused.clamp_pack_(y, 6.0)
            assert _same(y, want) and torch.equal(packed, _act_mask(want, 1, 6.0))
            gy = torch.randn(n)
            assert _same(fused.mask_mul(gy, packed, False),
                         unpack_as(packed, (n,), unpack_table(torch.float32, "cpu")).mul_(gy))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", ["transposed", "permuted", "channel-slice"])
def test_a_fused_relu_on_what_the_kernels_do_not_pack_runs_torch_s_ops(case):
    """A LeanReLU set to fused meets a dense tensor in another memory order, or a non-dense one: it
    runs torch's ops there (``fused.fusable``), the same gradient as aten."""
    from edgetl.models.lean import LeanReLU6

    def make(base):
        if case == "transposed":
            return base.reshape(10, 12).t()
        if case == "permuted":
            return base.reshape(1, 2, 3, 20).permute(0, 1, 3, 2)
        return base.reshape(2, 6, 2, 5)[:, 1:4]

    grads = {}
    for kernels in ("aten", "fused"):
        base = torch.randn(120, generator=torch.Generator().manual_seed(3)).mul_(4).requires_grad_()
        x = make(base) * 1.0  # a fresh tensor nothing else saved, in the case's layout
        layer = LeanReLU6()
        set_mask_kernels(layer, kernels)
        out = layer(x)
        out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape))
        grads[kernels] = base.grad
    assert _same(grads["fused"], grads["aten"])


def _trained(options: LeanOptions, mode: str, kernels: str, steps: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = build_network(TINY, mode, device="cpu", lean=LeanOptions(**{**vars(options), "mask_kernels": kernels}))
    torch.manual_seed(1)  # the classifier's dropout draws alike in both runs
    step = Step.plain("adam", 1e-3)
    opt = step.optimizer(net)
    gen = torch.Generator().manual_seed(2)
    image = torch.randn(4, 3, 48, 48, generator=gen)
    if net.input_dtype == torch.uint8:
        image = image.mul_(64).add_(128).clamp_(0, 255)
    image = image.to(net.input_dtype, memory_format=net.input_memory_format)
    labels = torch.randint(0, 10, (4,), generator=gen)
    for _ in range(steps):
        training_step(net, step, opt, image, labels)
    return [p.detach().clone() for p in net.parameters()] + [b.clone() for b in net.buffers()]


STEPS = {
    "repnet": (LeanOptions(pool=1), "repnet"),
    "repnet-channels-last": (LeanOptions(pool=1, channels_last=True), "repnet"),
    "paper-bf16-int8-streamed": (LeanOptions(pool=2, precision="bf16", frozen_weights="int8", stream=1,
                                             uint8_input=True, recompute=True), "repnet"),
    "bias": (LeanOptions(), "bias"),
    "full": (LeanOptions(), "full"),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_a_fused_step_trains_the_same_weights_bit_for_bit(name):
    options, mode = STEPS[name]
    aten, fused_run = _trained(options, mode, "aten"), _trained(options, mode, "fused")
    assert len(aten) == len(fused_run)
    for a, b in zip(aten, fused_run):
        assert _same(a, b)


@pytest.mark.parametrize("name", ["repnet-channels-last", "paper-bf16-int8-streamed", "full"])
def test_a_fused_step_is_predicted_as_measured_and_holds_no_more_than_the_aten_step(name):
    options, mode = STEPS[name]
    peaks, ops = {}, {}
    for kernels in ("aten", "fused"):
        net = build_network(TINY, mode, device="cpu", lean=LeanOptions(**{**vars(options), "mask_kernels": kernels}))
        predicted = predict_step(net, mode=mode, resolution=48, batch_size=4).total_bytes
        measured = measure_training_memory(net, resolution=48, batch_size=4)
        assert predicted == measured.tensor_bytes  # the accounting (meta) against the meter (real CPU step)
        counted = count_step_ops(net, resolution=48, batch_size=4)  # on a meta copy, by its own counter
        assert counted.total == measured.ops.total  # the meter's count of the real step's second step
        peaks[kernels], ops[kernels] = predicted, counted
    assert peaks["fused"] <= peaks["aten"]
    assert ops["fused"].total < ops["aten"].total and ops["fused"].kernel_total < ops["aten"].kernel_total


def test_every_masked_layer_is_set_and_aten_leaves_the_layers_as_they_were():
    net = build_network(TINY, "repnet", device="cpu", lean=LeanOptions(mask_kernels="fused"))
    masked = [m for m in net.modules() if type(m).__name__ in ("FrozenConvBNAct", "LeanReLU", "LeanReLU6")]
    assert masked and all(m.mask_kernels == "fused" for m in masked)
    assert set_mask_kernels(net, "aten") == len(masked)
    assert all("mask_kernels" not in vars(m) and m.mask_kernels == "aten" for m in masked)


def test_what_a_build_lacks_is_named_compiler_then_ninja_then_setuptools(monkeypatch, tmp_path):
    """``fused.missing`` (the bench's, the tests' and the demo's question): torch's extension
    builder needs a C++ compiler, ninja and setuptools (it imports it; the Jetson stack's torch
    2.5 too)."""
    import importlib.util

    assert fused.missing() is None and fused.buildable()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "setuptools" else find_spec(name, *a))
    assert fused.missing() == "setuptools (torch's extension builder imports it)" and not fused.buildable()
    monkeypatch.setenv("CXX", fused.compiler())
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: no ninja
    assert fused.missing() == "ninja"
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert fused.missing() == "a C++ compiler (CXX, else c++)"


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="mask_kernels is 'triton'; allowed: 'aten', 'fused'"):
        LeanOptions(mask_kernels="triton")
    with pytest.raises(CapabilityError, match="mask_kernels fused runs on CPU and CUDA; the network is on mps"):
        fused.check_device("mps")
    with pytest.raises(ConfigError, match="mask_kernels fused does not apply to mode repnet on stock modules"):
        LeanOptions(mask_kernels="fused").for_mode("repnet", "stock", defaults=LeanOptions())


def test_a_machine_without_a_compiler_gets_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    proc = subprocess.run([sys.executable, "-m", "edgetl", "profile", "--mask-kernels", "fused", "--resolution", "64",
                           "--accounting", "runtime"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "mask_kernels fused: compiling masks.cpp failed" in lines[0], proc.stderr
    assert "or use mask_kernels aten" in lines[0]


def test_the_bench_leaves_fused_rows_out_off_a_cpu_and_refuses_them_where_they_have_no_kernel(monkeypatch):
    from edgetl.bench import METHODS, check_methods, default_methods

    fused_rows = [n for n, m in METHODS.items() if m.lean is not None and m.lean.mask_kernels == "fused"]
    assert fused_rows and all(n in default_methods() for n in fused_rows)
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # a machine that cannot build them leaves them out too
    assert default_methods() == [n for n in default_methods(device="cuda")]
    monkeypatch.delenv("CXX")
    assert default_methods(device="cuda") == [n for n in default_methods() if n not in fused_rows]
    with pytest.raises(CapabilityError, match="mask_kernels fused runs on CPU and CUDA; the network is on mps"):
        check_methods([fused_rows[0]], "mobilenet_v2", "mps")
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    sys.path.insert(0, scripts)
    try:
        from gpu_check import bench_methods
    finally:
        sys.path.remove(scripts)
    rows = bench_methods()  # what the GPU check benches on CUDA
    assert rows and not set(rows) & set(fused_rows)
    check_methods(rows, "mobilenet_v2", "cuda")


def test_finetune_refuses_fused_kernels_on_a_gpu_it_cannot_build_them_for_before_it_writes_anything(
        tmp_path, monkeypatch):
    """finetune makes the network lean on the CPU and moves it after: the device is checked (and
    the CUDA kernels built) first."""
    from edgetl.finetune import finetune
    from edgetl.recipe import load_recipe

    recipe = load_recipe("fashion_mnist", {"model.backbone": "mobilenet_v2:random", "model.mask_kernels": "fused"})
    out = tmp_path / "run"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, but no toolkit
    monkeypatch.setattr(fused, "cuda_home", lambda: None)
    needs = r"mask_kernels fused on cuda needs the CUDA toolkit \(nvcc, cuda_runtime_api.h"
    with pytest.raises(CapabilityError, match=needs):
        finetune(recipe=recipe, out_dir=out, device="cuda")
    assert not out.exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU at all
    with pytest.raises(CapabilityError, match="torch sees no CUDA device"):
        finetune(recipe=recipe, out_dir=out, device="cuda")
    assert not out.exists()


# ---------------------------------------------------------------------------- CUDA (a GPU and nvcc)

CUDA_READY = torch.cuda.is_available() and fused.cuda_home() is not None


def cuda(fn):
    """Marker ``cuda`` (scripts/gpu_check.sh runs these) + skip with the reason elsewhere."""
    reason = "needs a CUDA GPU and the CUDA toolkit (nvcc) to build the CUDA kernels (scripts/gpu_check.sh)"
    return pytest.mark.cuda(pytest.mark.skipif(not CUDA_READY, reason=reason)(fn))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_cuda_kernels_give_torch_s_values_on_the_gpu(dtype, channels_last):
    fused.prepare("cuda")
    for shape, upper in (((3, 24, 33, 17), 6.0), ((2, 3, 5, 7), None), ((4, 16, 8, 8), 6.0)):
        y = _activation(shape, dtype, channels_last).cuda()
        want = y.clone()
        want.clamp_(0, upper) if upper is not None else want.clamp_(min=0)
        want_packed = _act_mask(want, 1, upper)
        packed = fused.clamp_pack_(y, upper)
        assert packed.is_cuda and _same(y.cpu(), want.cpu()) and torch.equal(packed.cpu(), want_packed.cpu())
        for layout in (channels_last, not channels_last):
            gy = _activation(shape, dtype, layout, seed=1).cuda()
            got = fused.mask_mul(gy, packed, channels_last)
            ref = unpack_as(packed, shape, unpack_table(dtype, gy.device), channels_last).mul_(gy)
            assert got.stride() == ref.stride() and _same(got.cpu(), ref.cpu())


@cuda
@pytest.mark.parametrize("name", ["repnet-channels-last", "paper-bf16-int8-streamed"])
def test_a_fused_step_on_the_gpu_is_predicted_and_trains_as_torch_s(name):
    """The tensor peak of fused steps on CUDA equals the runtime accounting to the byte, and a
    step's gradients are the aten step's (cuDNN may pick other algorithms between runs: to 1e-5)."""
    from edgetl.memory.runtime import runtime_report

    options, mode = STEPS[name]
    grads = {}
    for kernels in ("aten", "fused"):
        torch.manual_seed(0)
        net = build_network(TINY, mode, device="cuda",
                            lean=LeanOptions(**{**vars(options), "mask_kernels": kernels}))
        predict_step(net, mode=mode, resolution=48, batch_size=4)
        runtime = runtime_report(net, mode=mode, resolution=48, batch_size=4).total_bytes
        got = measure_training_memory(net, resolution=48, batch_size=4)
        assert got.tensor_bytes == runtime, (kernels, got.tensor_bytes, runtime)
        torch.manual_seed(0)
        net = build_network(TINY, mode, device="cuda",
                            lean=LeanOptions(**{**vars(options), "mask_kernels": kernels}))
        torch.manual_seed(1)
        step = Step.plain("adam", 1e-3)
        gen = torch.Generator().manual_seed(2)
        image = torch.randn(4, 3, 48, 48, generator=gen)
        if net.input_dtype == torch.uint8:
            image = image.mul_(64).add_(128).clamp_(0, 255)
        image = image.to("cuda", net.input_dtype, memory_format=net.input_memory_format)
        labels = torch.randint(0, 10, (4,), generator=gen).cuda()
        training_step(net, step, step.optimizer(net), image, labels)
        grads[kernels] = [p.detach().float().cpu() for p in net.parameters() if p.requires_grad]
    for a, b in zip(grads["aten"], grads["fused"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
