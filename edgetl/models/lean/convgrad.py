"""A conv's input gradient from its weight and its output's gradient alone (the lean layers'
backward, which keeps no input), and a channels-last 1x1 conv as a matrix product."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

from edgetl.models.lean.layout import from_memory_order, is_channels_last, rows_of_channels, transposed_matrix


def conv_input_grad(in_shape, weight: torch.Tensor, grad_output: torch.Tensor, stride=1, padding=0,
                    dilation=1, groups: int = 1) -> torch.Tensor:
    """The gradient of ``conv2d``'s input of shape ``in_shape``, as the transposed convolution of
    ``grad_output`` (the output padding gives back the input's size where a stride dropped rows).

    The same values as ``torch.nn.grad.conv2d_input`` (bit for bit on CPU in fp32 and bf16, every
    conv of MobileNetV2 and ResNet-18 but the 1x1 ones below; ``tests/test_convgrad.py``), in one op where it takes
    three, and without what it costs on CPU: it hands ``convolution_backward`` a one-value input
    expanded to the input's shape, which the CPU kernel makes contiguous, an input-sized copy
    allocated and filled inside the op (scratch no tensor meter sees, ``docs/memory.md``). On
    CPU a depthwise conv's input gradient runs about 1.5x faster this way (one thread, batch 8,
    224 px). On CUDA both are cuDNN's backward-data convolution.

    Off CUDA a 1x1 conv of stride 1 is a batched matrix product instead: CPU's transposed conv
    of a 1x1 weight is PyTorch's own kernel, which fills a scratch as large as its output
    (unseen by any tensor meter) and over MobileNetV2's 1x1 convs at batch 8, 224 px takes
    68 ms where the product takes 49, with nothing allocated but the result. Its sums run in
    another order: the same values to rounding (bit for bit at those shapes, not at every
    shape; ``tests/test_convgrad.py``). A channels-last ``grad_output`` is one matrix product
    of its pixels (its rows in memory) against the weight, and the gradient comes back
    channels-last; a transposed conv keeps the layout it is given as well."""
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    kernel = weight.shape[2:]
    if tuple(kernel) == (1, 1) and stride == (1, 1) and padding == (0, 0) and groups == 1 \
            and grad_output.device.type != "cuda":
        if is_channels_last(grad_output):  # pixels as rows: one product (n h w, out) @ (out, in)
            g = rows_of_channels(grad_output)
            gx = torch.mm(g, weight.reshape(weight.shape[0], -1))
            return from_memory_order(gx, in_shape, channels_last=True)
        # W^T @ grad_output, one matrix product per sample against the weight's transposed view
        n = grad_output.shape[0]
        return torch.bmm(transposed_matrix(weight, n), grad_output.flatten(2)).view(in_shape)
    output_padding = tuple((int(in_shape[2 + i]) + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) % stride[i]
                           for i in range(2))
    return F.conv_transpose2d(grad_output, weight, None, stride, padding, output_padding, groups, dilation)


def pointwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A 1x1 conv of stride 1 without padding of a channels-last ``x``, as one matrix product of
    its pixels (its rows in memory) against the weight, the bias added inside the product
    (``addmm``): the output comes back channels-last. On CPU torch's conv runs such a conv
    through a slower path (over MobileNetV2's 34 1x1 convs at batch 8, 224 px, one thread: 62 ms
    where the products take 45), and a separate bias add is one more pass over the output."""
    rows = rows_of_channels(x)
    w = transposed_matrix(weight)
    y = torch.mm(rows, w) if bias is None else torch.addmm(bias, rows, w)
    return from_memory_order(y, (x.shape[0], weight.shape[0], x.shape[2], x.shape[3]), channels_last=True)
