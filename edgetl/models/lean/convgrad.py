"""A conv's input gradient from its weight and its output's gradient alone: the lean layers'
backward, which keeps no input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair


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
    shape; ``tests/test_convgrad.py``)."""
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    kernel = weight.shape[2:]
    if tuple(kernel) == (1, 1) and stride == (1, 1) and padding == (0, 0) and groups == 1 \
            and grad_output.device.type != "cuda":
        # W^T @ grad_output, one matrix product per sample against the weight's transposed view
        n = grad_output.shape[0]
        return torch.bmm(weight.flatten(1).t().expand(n, -1, -1), grad_output.flatten(2)).view(in_shape)
    output_padding = tuple((int(in_shape[2 + i]) + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) % stride[i]
                           for i in range(2))
    return F.conv_transpose2d(grad_output, weight, None, stride, padding, output_padding, groups, dilation)
