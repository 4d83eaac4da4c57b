"""The lean layers' conv input gradient (``conv_input_grad``: a transposed conv, or off CUDA a
batched matrix product for a 1x1 conv of stride 1) against ``torch.nn.grad.conv2d_input`` on every
conv of MobileNetV2 and ResNet-18, and against the CPU allocator's events: it allocates its output
and never a copy of the input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch.nn.grad import conv2d_input

from edgetl.memory.alloc_events import record_allocations
from edgetl.models.lean.convgrad import conv_input_grad


def conv_calls(model: torch.nn.Module, batch: int, resolution: int) -> list[tuple[torch.nn.Conv2d, torch.Size]]:
    """Each conv of ``model`` with the input shape it sees on a batch at ``resolution``."""
    calls = []
    hooks = [m.register_forward_hook(lambda m, i, o: calls.append((m, i[0].shape)))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model.eval()(torch.randn(batch, 3, resolution, resolution))
    for h in hooks:
        h.remove()
    return calls


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def is_matrix_product(m: torch.nn.Conv2d) -> bool:
    """Whether ``conv_input_grad`` runs this conv's input gradient as a batched matrix product (CPU)."""
    return m.kernel_size == (1, 1) and m.stride == (1, 1) and m.padding == (0, 0) and m.groups == 1


@pytest.mark.parametrize("arch, resolution", [("mobilenet_v2", 72), ("resnet18", 65)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_same_bits_as_conv2d_input(arch, resolution, dtype):
    # odd sizes (65 px) make the strided convs drop a row: the output padding gives it back
    torch.manual_seed(0)
    calls = conv_calls(getattr(torchvision.models, arch)(), 2, resolution)
    assert len(calls) > 15
    for m, shape in calls:
        w = m.weight.detach().to(dtype)
        out_shape = F.conv2d(torch.empty(shape, dtype=dtype), w, None, m.stride, m.padding, m.dilation,
                             m.groups).shape
        gy = torch.randn(out_shape).to(dtype)
        mine = conv_input_grad(shape, w, gy, m.stride, m.padding, m.dilation, m.groups)
        theirs = conv2d_input(shape, w, gy, m.stride, m.padding, m.dilation, m.groups)
        assert mine.shape == shape and mine.dtype == dtype
        if is_matrix_product(m):  # another kernel's order of sums: the same values to rounding
            torch.testing.assert_close(mine, theirs, msg=str((arch, m)), **TOLERANCE[dtype])
        else:
            assert torch.equal(mine, theirs), (arch, m)


def test_a_dilated_strided_conv_too():
    w, shape = torch.randn(6, 3, 3, 3), (2, 3, 17, 16)
    gy = torch.randn(F.conv2d(torch.empty(shape), w, None, 2, 2, 2).shape)
    assert torch.equal(conv_input_grad(shape, w, gy, 2, 2, 2), conv2d_input(shape, w, gy, 2, 2, 2))


def test_it_allocates_no_copy_of_the_input():
    """conv2d_input hands the kernel a one-value input expanded to the input's shape, which the
    CPU kernel makes contiguous: an input-sized block taken by ``aten::empty`` inside
    ``convolution_backward``, beside oneDNN's blocked copies (its kernel's own). The transposed
    conv has the same oneDNN copies and output, one block fewer in all, and no one-value input."""
    shape, w = (4, 32, 28, 28), torch.randn(32, 1, 3, 3)
    gy = torch.randn(shape)
    nbytes = 4 * 32 * 28 * 28 * 4

    def blocks(run) -> list[tuple[int, str, str]]:
        out, events = record_allocations(run)
        assert out.shape == shape
        return [(a.nbytes, a.kind, a.kernel) for a in events.allocations]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # oneDNN's scratch depends on the thread count
    try:
        theirs, mine = blocks(lambda: conv2d_input(shape, w, gy, 1, 1, 1, 32)), blocks(lambda: conv_input_grad(
            shape, w, gy, 1, 1, 1, 32))
    finally:
        torch.set_num_threads(threads)
    assert (nbytes, "scratch", "aten::empty") in theirs and (4, "tensor", "aten::empty") in theirs
    assert [b for b in mine if b[1] == "scratch" and b[2] == "aten::empty"] == []
    assert len(mine) == len(theirs) - 2
    assert sum(b[0] for b in mine) == sum(b[0] for b in theirs) - nbytes - 4


def test_a_1x1_conv_takes_no_scratch():
    """A 1x1 conv's input gradient off CUDA is a batched matrix product against the weight's
    transposed view: its result is the only block the allocator hands out, where the transposed
    conv (PyTorch's own kernel for a 1x1 weight on CPU) also fills a scratch of the result's size."""
    shape, w = (4, 96, 14, 14), torch.randn(24, 96, 1, 1)
    gy = torch.randn(4, 24, 14, 14)
    nbytes = 4 * 96 * 14 * 14 * 4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mine, mine_events = record_allocations(lambda: conv_input_grad(shape, w, gy))
        theirs, theirs_events = record_allocations(lambda: F.conv_transpose2d(gy, w))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(mine, theirs) and mine.shape == shape
    assert [(a.nbytes, a.kind) for a in mine_events.allocations] == [(nbytes, "tensor")]
    assert (nbytes, "scratch") in [(a.nbytes, a.kind) for a in theirs_events.allocations]
