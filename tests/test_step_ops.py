"""Ops and kernels per step (``count_step_ops``) against a count written here, the committed
step-ops table against a recount, and the 1-bit mask packing against a plain packer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgetl.bench import METHODS, build_method, pruned_hidden
from edgetl.memory.meter import count_step_ops
from edgetl.memory.schedule import prepare_step
from edgetl.metaop import meta_call
from edgetl.models.backbone import BackboneSpec
from edgetl.models.lean import fused
from edgetl.models.lean.masks import _fold_bits, pack_mask, unpack_mask
from edgetl.models.side import LeanOptions, build_network
from edgetl.step import Step, set_train_mode, training_step

ROOT = Path(__file__).resolve().parents[1]
RES, BATCH = 64, 4
SPEC = BackboneSpec(width=0.35, num_classes=10)
# no kernel on a device: metadata-only views, allocator blocks, the profiler's records
NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "expand", "unsqueeze", "squeeze", "t", "transpose",
             "permute", "detach", "alias", "as_strided", "_reshape_alias", "empty", "new_empty", "empty_like",
             "empty_strided", "new_empty_strided", "_record_function_enter_new", "_record_function_exit"}


class _Names(TorchDispatchMode):
    """Every op's name, in order (this test's own count: a name list, no shared rule)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return meta_call(func, args, kwargs or {})  # runs it (scalars on meta too); counts nothing


def _split_step(net) -> dict[str, list[str]]:
    """The op names of the second plain step of a meta ``net``: forward, to the optimizer, optimizer."""
    step = Step.plain()
    opt = step.optimizer(net)
    set_train_mode(net, step.bn)
    x = torch.empty(BATCH, 3, RES, RES, device="meta")
    y = torch.zeros(BATCH, dtype=torch.int64, device="meta")
    training_step(net, step, opt, x, y)
    mode = _Names()
    at: dict[str, int] = {}

    def mark(name):
        def hook(*args) -> None:  # returns None: a pre-hook's value would replace the input
            at.setdefault(name, len(mode.names))
        return hook

    hooks = [net.register_forward_pre_hook(mark("start")), net.register_forward_hook(mark("forward")),
             opt.register_step_pre_hook(mark("backward"))]
    with mode:
        training_step(net, step, opt, x, y)
    for h in hooks:
        h.remove()
    n = mode.names
    return {"forward": n[at["start"]:at["forward"]], "backward": n[at["forward"]:at["backward"]],
            "optimizer": n[at["backward"]:]}


@pytest.mark.parametrize("lean", [None, LeanOptions(pool=1), LeanOptions(pool=2, precision="bf16",
                                                                         frozen_weights="int8")])
def test_ops_and_kernels_match_a_count_by_name(lean):
    net = build_network(SPEC, "repnet", device="meta", lean=lean)
    prepare_step(net, resolution=RES, batch_size=BATCH)
    ops = count_step_ops(net, resolution=RES, batch_size=BATCH)
    parts = _split_step(net)
    assert (ops.forward, ops.backward, ops.optimizer) == tuple(len(parts[k]) for k in ("forward", "backward",
                                                                                      "optimizer"))
    kernels = tuple(sum(name not in NO_KERNEL for name in parts[k]) for k in ("forward", "backward", "optimizer"))
    assert ops.kernels == kernels
    assert 0 < ops.kernel_total < ops.total


def test_lean_fitted_step_launches_its_counted_kernels():
    """MobileNetV2 0.35 lean Rep-Net at 64 px, fitted: the frozen convs' forward is a conv, a bias
    add, the clamp and the mask of the clamped output (a conversion to bool, the bound's bits
    subtracted, a second conversion, an and, the bits added back, one multiply that folds 8 bits
    into a byte, the packed bytes copied out); no comparison (on CPU a comparison that writes
    bools is a scalar loop) and no shift-or of the mask packing is left."""
    net = build_network(SPEC, "repnet", device="meta", lean=LeanOptions(pool=1))
    prepare_step(net, resolution=RES, batch_size=BATCH)
    parts = _split_step(net)
    assert "__rshift__" not in parts["forward"] and "bitwise_or_" not in parts["forward"]
    assert "gt" not in parts["forward"] and "lt" not in parts["forward"]
    masks = parts["forward"].count("bitwise_and_")  # one and per ReLU6 mask
    assert masks > 0 and parts["forward"].count("_to_copy") >= 2 * masks
    # one arange per unpack table (the shifts are a view of the codes)
    tables = parts["backward"].count("bitwise_right_shift")
    assert tables > 0 and parts["backward"].count("arange") == tables


def test_committed_step_ops_table_is_recounted():
    """benchmarks/step_ops_224.json (docs/lean-runtime.md's table): stock Rep-Net and, fitted, lean
    Rep-Net plain and channels-last and the paper's bf16 + int8 configuration (with the fused mask
    kernels too where they build), recounted at 224 px on meta (seconds)."""
    data = json.loads((ROOT / "benchmarks" / "step_ops_224.json").read_text())
    rows = {(r["method"], r["schedule"]): r for r in data["rows"]}
    names = ["repnet-lean", "repnet-lean-cl", "repnet-pruned-pool2-bf16-int8"] + (
        ["repnet-lean-cl-fused", "repnet-pruned-pool2-bf16-int8-fused"] if fused.buildable() else [])
    for name, schedule in (("repnet-stock", "no schedule"), *((n, "fitted") for n in names)):
        method = METHODS[name]
        net = build_method(method, width=1.0, num_classes=data["num_classes"], device="meta",
                           hidden=pruned_hidden(1.0, data["num_classes"]) if method.pruned else None)
        prepare_step(net, resolution=data["resolution"], batch_size=data["batch_size"])
        ops = count_step_ops(net, resolution=data["resolution"], batch_size=data["batch_size"])
        row = rows[(name, schedule)]
        assert (row["forward"], row["backward"], row["optimizer"], row["total"]) == \
            (ops.forward, ops.backward, ops.optimizer, ops.total)
        assert (row["kernels"], row["kernel_total"]) == (list(ops.kernels), ops.kernel_total)
    stock, lean = rows[("repnet-stock", "no schedule")], rows[("repnet-lean", "fitted")]
    assert stock["optimizer"] == lean["optimizer"]


@pytest.mark.parametrize("numel", [8, 64, 4096, 13, 1001])
def test_mask_packing_matches_a_plain_packer(numel):
    g = torch.Generator().manual_seed(numel)
    for mask in (torch.rand(numel, generator=g) < 0.5, torch.ones(numel, dtype=torch.bool),
                 torch.zeros(numel, dtype=torch.bool)):
        bits = torch.nn.functional.pad(mask.to(torch.int64), (0, (-numel) % 8)).view(-1, 8)
        plain = (bits << torch.arange(8)).sum(1).to(torch.uint8)
        assert torch.equal(pack_mask(mask), plain)
        assert torch.equal(unpack_mask(plain, (numel,)), mask)
        if numel % 8 == 0:
            flat = mask.to(torch.uint8)
            assert torch.equal(_fold_bits(flat), plain) and torch.equal(flat, mask.to(torch.uint8))


def test_a_layout_view_is_the_two_view_tensor_in_one_op():
    """The lean layers' channels-last views (pixel rows, memory order, a 1x1 weight's transposed
    matrix) are the tensors a permute and a view make (the same storage, offset, sizes, strides
    and values) in one dispatched op; where autograd records them, the two views (an
    ``as_strided`` backward would allocate a gradient as large as the whole storage)."""
    from edgetl.models.lean.layout import from_memory_order, memory_flat, rows_into, rows_of_channels, \
        transposed_matrix

    g = torch.Generator().manual_seed(0)
    batch = torch.randn(3, 5, 4, 6, generator=g).contiguous(memory_format=torch.channels_last)
    x = batch[1:]  # a storage offset to keep
    w = torch.randn(7, 5, 1, 1, generator=g)
    flat = torch.randn(2 * 5 * 4 * 6, generator=g)[:]
    cases = [
        (lambda: rows_of_channels(x), x.permute(0, 2, 3, 1).reshape(-1, 5)),
        (lambda: rows_into(x), x.permute(0, 2, 3, 1).view(-1, 5)),
        (lambda: memory_flat(x), x.permute(0, 2, 3, 1).reshape(-1)),
        (lambda: from_memory_order(flat, (2, 5, 4, 6), True), flat.view(2, 4, 6, 5).permute(0, 3, 1, 2)),
        (lambda: transposed_matrix(w), w.reshape(7, 5).t()),
        (lambda: transposed_matrix(w.contiguous(memory_format=torch.channels_last)), w.reshape(7, 5).t()),
        (lambda: transposed_matrix(w, 3), w.reshape(7, 5).t().expand(3, -1, -1)),
    ]
    for make, want in cases:
        mode = _Names()
        with mode:
            got = make()
        assert mode.names == ["as_strided"]
        assert got.untyped_storage().data_ptr() == want.untyped_storage().data_ptr()
        assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
        assert torch.equal(got, want)
    leaf = x.detach().requires_grad_()
    rows = rows_of_channels(leaf)
    assert "AsStrided" not in type(rows.grad_fn).__name__
    rows.sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))
    with torch.no_grad():
        mode = _Names()
        with mode:
            rows_of_channels(leaf)
        assert mode.names == ["as_strided"]


@pytest.mark.skipif(not fused.buildable(), reason="the fused mask kernels need a C++ compiler and ninja to build")
def test_the_fused_lean_step_with_the_fused_adam_dispatches_less_than_stocks_default_step():
    """docs/lean-runtime.md: at 224 px, batch 8, lean Rep-Net channels-last with the fused mask
    kernels and Adam's fused kernel (``--fused``) dispatches fewer ops and launches fewer
    kernels than stock Rep-Net's default step (Adam's per-parameter loop): 886 and 505 against
    906 and 774; with the fused Adam in both, stock's are fewer (566 and 436)."""
    counts = {}
    for name in ("repnet-stock", "repnet-lean-cl-fused"):
        net = build_method(METHODS[name], width=1.0, num_classes=102, device="meta")
        prepare_step(net, resolution=224, batch_size=8)
        for fused_adam in (False, True):
            counts[name, fused_adam] = count_step_ops(net, resolution=224, batch_size=8,
                                                      step=Step.plain(fused=fused_adam))
    lean, stock = counts["repnet-lean-cl-fused", True], counts["repnet-stock", False]
    assert (lean.total, lean.kernel_total) == (886, 505) and (stock.total, stock.kernel_total) == (906, 774)
    assert (counts["repnet-stock", True].total, counts["repnet-stock", True].kernel_total) == (566, 436)
