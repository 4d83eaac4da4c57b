"""Lean Rep-Net side modules: a stock SideNetwork (or its sizes) in, side modules whose saved bytes really drop out.

Same computation and state_dict keys as ``edgetl.models.side.SideModule`` (conv1.weight,
bn1.*, conv2.weight, bn2.*). What each part keeps for backward:

    pool (2x2, and 4x4 on the image)   nothing (stock AvgPool2d keeps its full input)
    conv1 (k x k, trainable)           its input average-pooled by ``pool`` (PooledConv2d;
                                       small maps by less or not at all: stored_pools)
    bn1 -> ReLU -> conv2 -> bn2        bn1's input (exact, fp32) + per-channel batch stats;
                                       the ReLU output (conv2's input) and bn2's input are
                                       recomputed from it in backward (one extra 1x1 conv)
    bilinear resize                    nothing

BN's own backward needs its full input, so pooling conv2's input would not save a byte:
conv2's input is recomputed from bn1's input instead, which makes conv2's and both BNs'
gradients exact. The only approximation is conv1's grad_weight (see
``edgetl.models.lean.pooled_grad_weight``). Stock keeps conv1's input, bn1's input,
the ReLU output (= conv2's input) and bn2's input, all full size and fp32.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.nn.grad import conv2d_weight

from edgetl.models.lean import ImagePool, LeanAvgPool2d, PooledConv2d, _check_pool
from edgetl.models.lean.convgrad import conv_input_grad
from edgetl.models.lean.frozen import update_running_stats
from edgetl.units import round_up

_C = (1, -1, 1, 1)


def _bn_apply(y, mean, invstd, gamma, beta, out=None):
    """BN with given statistics; into ``out`` (may be ``y`` itself) or one new tensor."""
    scale = invstd * gamma
    shift = beta - mean * scale
    if out is None:
        out = y * scale.view(_C)
    else:
        out = torch.mul(y, scale.view(_C), out=out)
    return out.add_(shift.view(_C))


def _batch_stats(y, bn: nn.BatchNorm2d, momentum: float):
    """Batch mean and invstd of y per channel; updates bn's running statistics like nn.BatchNorm2d.

    One value per channel is refused as nn.BatchNorm2d refuses it, except on the meta device:
    the runtime accounting's per-image figures measure this code at one sample there
    (``edgetl.memory.leaf``), a call no real step makes."""
    n = y.numel() // y.shape[1]
    if n <= 1 and y.device.type != "meta":
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(y.shape)}")
    var, mean = torch.var_mean(y, dim=(0, 2, 3), correction=0)
    if bn.track_running_stats:
        unbiased = n / (n - 1) if n > 1 else 1.0  # (one value: meta only, values unread)
        update_running_stats((bn.running_mean, bn.running_var), (mean, var * unbiased), momentum)
    return mean, torch.rsqrt(var + bn.eps)


def _eval_stats(bn: nn.BatchNorm2d):
    return bn.running_mean, torch.rsqrt(bn.running_var + bn.eps)


class _SideTailFn(Function):
    """bn1 -> ReLU -> conv2 (1x1) -> bn2, saving only bn1's input and the batch statistics."""

    @staticmethod
    def forward(ctx, y1, g1, b1, w2, g2, b2, tail: "LeanSideTail", batch: bool, m1: float, m2: float):
        bn1, conv2, bn2 = tail.parts
        if tail.shapes_only:  # a meta trace: the output's shape and dtype (conv2's) are all it reads
            return F.conv2d(y1.to(w2.dtype), w2)
        if batch:
            mean1, invstd1 = _batch_stats(y1, bn1, m1)
        else:
            mean1, invstd1 = _eval_stats(bn1)
        a1 = _bn_apply(y1, mean1, invstd1, g1, b1).clamp_(min=0)
        y2 = F.conv2d(a1, w2)
        del a1
        if batch:
            mean2, invstd2 = _batch_stats(y2, bn2, m2)
        else:
            mean2, invstd2 = _eval_stats(bn2)
        out = _bn_apply(y2, mean2, invstd2, g2, b2, out=y2)  # y2 is not needed again: in place
        ctx.batch, ctx.eps = batch, (bn1.eps, bn2.eps)
        if batch:
            ctx.save_for_backward(y1, g1, b1, w2, g2, mean1, invstd1, mean2, invstd2)
        else:
            # running statistics are buffers: saving them keeps no new storage
            ctx.save_for_backward(
                y1, g1, b1, w2, g2, bn1.running_mean, bn1.running_var, bn2.running_mean, bn2.running_var
            )
        return out

    @staticmethod
    def backward(ctx, gz):
        y1, g1, b1, w2, g2, s1, s2, s3, s4 = ctx.saved_tensors
        eps1, eps2 = ctx.eps
        need = ctx.needs_input_grad
        if ctx.batch:
            mean1, invstd1, mean2, invstd2 = s1, s2, s3, s4
            rm1 = rv1 = rm2 = rv2 = None
        else:
            rm1, rv1, rm2, rv2 = s1, s2, s3, s4
            mean1, invstd1 = rm1, torch.rsqrt(rv1 + eps1)
            mean2 = invstd2 = None
        # recompute what stock autograd would have stored: bn1 output, ReLU output, bn2 input
        a1 = _bn_apply(y1, mean1, invstd1, g1, b1).clamp_(min=0)
        y2 = F.conv2d(a1, w2)
        gy2, gg2, gb2 = torch.ops.aten.native_batch_norm_backward(
            gz, y2, g2, rm2, rv2, mean2, invstd2, ctx.batch, eps2, [True, need[4], need[5]]
        )
        del y2
        gw2 = conv2d_weight(a1, w2.shape, gy2) if need[3] else None
        ga1 = conv_input_grad(a1.shape, w2, gy2)
        del gy2
        # ReLU's backward from its output, in place: no mask (``ga1 * bool_mask`` would
        # also cast the mask to a hidden float copy inside the kernel on CPU)
        go1 = torch.ops.aten.threshold_backward.grad_input(ga1, a1, 0, grad_input=ga1)
        del a1
        gy1, gg1, gb1 = torch.ops.aten.native_batch_norm_backward(
            go1,
            y1,
            g1,
            rm1,
            rv1,
            mean1 if ctx.batch else None,
            invstd1 if ctx.batch else None,
            ctx.batch,
            eps1,
            [need[0], need[1], need[2]],
        )
        return gy1, gg1, gb1, gw2, gg2, gb2, None, None, None, None


class LeanSideTail(nn.Module):
    """Leaf running a side module's bn1 -> ReLU -> conv2 -> bn2 as one lean function.

    Holds plain (unregistered) references to the owning module's bn1, conv2, bn2, so
    parameters keep their stock names; tracing sees this as one leaf.
    """

    accounting_kind = "lean_side_tail"
    shapes_only = False  # a meta copy only traced forward (``mark_shapes_only``): no BN, no ReLU

    def __init__(self, bn1: nn.BatchNorm2d, conv2: nn.Conv2d, bn2: nn.BatchNorm2d):
        super().__init__()
        self.parts = (bn1, conv2, bn2)

    def needs_backward(self) -> bool:
        return any(p.requires_grad for m in self.parts for p in m.parameters())

    def forward(self, y1: torch.Tensor) -> torch.Tensor:
        bn1, conv2, bn2 = self.parts
        batch = bn1.training
        m1, m2 = _momentum(bn1), _momentum(bn2)
        return _SideTailFn.apply(
            y1, bn1.weight, bn1.bias, conv2.weight, bn2.weight, bn2.bias, self, batch, m1, m2
        )

    def runtime_parameters(self) -> list[nn.Parameter]:
        """The parameters this leaf uses (they are registered on the owning side module)."""
        return [p for m in self.parts for p in m.parameters()]

def _momentum(bn: nn.BatchNorm2d) -> float:
    """nn.BatchNorm2d's update factor, bumping num_batches_tracked as it does in training."""
    if not (bn.training and bn.track_running_stats):
        return 0.0
    bn.num_batches_tracked.add_(1)
    return bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)


class LeanSideModule(nn.Module):
    """Rep-Net side module (DESIGN 3) built from lean parts; state_dict-compatible with SideModule."""

    lean = True

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        groups: int,
        image_pool: int = 1,
        pool: int = 2,
        mid_channels: int | None = None,
    ):
        super().__init__()
        mid = mid_channels if mid_channels is not None else round_up(in_channels, 8)
        self.in_channels, self.mid_channels, self.out_channels = in_channels, mid, out_channels
        self.pre_pool = ImagePool(image_pool) if image_pool > 1 else None
        self.pool = LeanAvgPool2d(2)
        self.conv1 = PooledConv2d(
            in_channels, mid, kernel_size, padding=kernel_size // 2, groups=groups, bias=False,
            pool=_check_pool(pool),
        )
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, out_channels, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        nn.init.zeros_(self.bn2.weight)
        self.tail = LeanSideTail(self.bn1, self.conv2, self.bn2)
        # dtype of the output (the backbone's activation dtype, set by leanify_backbone);
        # None keeps the weights' dtype. Casting here, before the resize, keeps the tap's
        # sum (and every residual stream after it) in the backbone's dtype.
        self.out_dtype: torch.dtype | None = None

    @property
    def activation_pool(self) -> int:
        return self.conv1.pool

    def forward(self, x: torch.Tensor, size) -> torch.Tensor:
        if self.pre_pool is not None:
            x = self.pre_pool(x)
        x = self.pool(x)
        # a bf16/fp16 lean backbone feeds low-precision activations: cast after pooling,
        # so no full-resolution fp32 copy is made
        x = x.to(self.conv1.weight.dtype)
        x = self.conv1(x)  # the cast copy is dropped here, not held through the tail
        x = self.tail(x)
        if self.out_dtype is not None:
            x = x.to(self.out_dtype)
        if tuple(x.shape[-2:]) != tuple(size):
            # bilinear upsampling saves nothing for backward
            x = F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)
        return x


def lean_side_module_from_stock(module: nn.Module, pool: int = 2) -> LeanSideModule:
    """A LeanSideModule with the stock module's sizes, weights, trainability and train/eval mode."""
    pre = module.pre_pool
    image_pool = pre.kernel_size if pre is not None else 1
    if isinstance(image_pool, tuple):
        image_pool = image_pool[0]
    conv1 = module.conv1
    p = next(module.parameters())
    with torch.device(p.device):
        lean = LeanSideModule(
            module.in_channels,
            module.out_channels,
            conv1.kernel_size[0],
            conv1.groups,
            image_pool=int(image_pool),
            pool=pool,
            mid_channels=module.mid_channels,
        ).to(p.dtype)
    lean.load_state_dict(module.state_dict())
    own = dict(lean.named_parameters())
    for name, param in module.named_parameters():
        own[name].requires_grad_(param.requires_grad)
    lean.train(module.training)
    return lean


def lean_side_from_stock(side_network: nn.Module, pool: int = 2, inplace: bool = False) -> nn.Module:
    """Convert a SideNetwork's modules to LeanSideModules (weights, trainability, mode kept).

    Args:
        side_network: an ``edgetl.models.side.SideNetwork``.
        pool: activation pool factor k for the side convs' stored inputs (1, 2 or 4).
        inplace: replace the modules inside ``side_network`` and return it; otherwise return
            a new SideNetwork and leave ``side_network`` untouched.
    """
    _check_pool(pool)
    target = side_network if inplace else type(side_network)([], side_network.taps)
    blocks = [lean_side_module_from_stock(b, pool) for b in side_network.blocks]
    target.blocks = nn.ModuleList(blocks)
    return target


def side_conv_sizes(net: nn.Module, resolution: int) -> list[tuple[int, int]]:
    """(H, W) of each side module's conv input at this resolution, stock or lean side network.

    Runs one forward of batch 1 under no_grad in eval mode, so no BN statistics move (free
    on a meta-device network); no forward at all without a side network.
    """
    side = net.side
    if side is None or not len(side.blocks):
        return []
    sizes: list[tuple[int, int]] = [(0, 0)] * len(side.blocks)

    def record(j):
        def hook(module, args):
            sizes[j] = tuple(args[0].shape[-2:])
        return hook

    handles = [b.conv1.register_forward_pre_hook(record(j)) for j, b in enumerate(side.blocks)]
    modes = {m: m.training for m in net.modules()}
    image = torch.zeros(1, 3, resolution, resolution, device=next(net.parameters()).device,
                        dtype=net.input_dtype).contiguous(memory_format=net.input_memory_format)
    try:
        net.eval()
        with torch.no_grad():
            net(image)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return sizes


def stored_pools(net: nn.Module, resolution: int) -> list[int]:
    """The factor each lean side module's conv really stores its input with, at this resolution.

    ``model.pool`` is a request: small maps are stored with less or no pooling
    (``edgetl.models.lean.effective_pool``). Empty for a network without lean side modules.
    """
    side = net.side
    if side is None or not all(isinstance(b, LeanSideModule) for b in side.blocks):
        return []
    return [b.conv1.pool_for(hw) for b, hw in zip(side.blocks, side_conv_sizes(net, resolution))]


def leanify_network(
    net: nn.Module,
    *,
    pool: int = 2,
    bn: str = "fold",
    weight_dtype: str | torch.dtype = "fp32",
    act_dtype: str | torch.dtype = "fp32",
) -> nn.Module:
    """Lean side network (pool k) + lean frozen backbone for a built EdgeNet, in place; returns ``net``."""
    from edgetl.models.lean import leanify_backbone

    if net.side is not None:
        lean_side_from_stock(net.side, pool=pool, inplace=True)
    return leanify_backbone(net, bn=bn, weight_dtype=weight_dtype, act_dtype=act_dtype)
