"""What a leaf layer keeps for backward and allocates while it runs: a leaf module and its shapes
in, a LayerCost out (the rule table of the runtime accounting, ``edgetl.memory.runtime``).

Stock rules (torch 2.14, train mode), checked layer by layer against the meter in
tests/test_runtime_accounting.py: conv saves its input whenever its output needs grad
(frozen or not); BN saves its input plus save_mean/save_invstd (2 x C floats);
in-place ReLU6 (``hardtanh_``) saves a *clone* of its input; in-place ReLU saves its
result (no copy); linear saves its input only if its weight trains; AvgPool2d saves
its input; AdaptiveAvgPool2d to 1x1 is a ``mean`` and saves nothing; dropout saves a
mask as large as its input (input dtype); bilinear resize, add and flatten save nothing.

Every other leaf - edgetl's lean layers (``edgetl.models.lean``, ``lean_side``,
``lean_full``, ``compress``), a streamed segment, a subclass of a stock layer, a user's own
layer - is measured, not described: it runs once on a meta twin of itself under the storage
meter (``edgetl.memory.leaf``), so what the accounting predicts is what its code allocates.
A leaf whose parameters are registered elsewhere (the lean side tail) lists them with
``runtime_parameters()``. A leaf that returns the very tensor it was given is taken as an
identity (no op, no grad_fn) unless it has ``inplace = True``, in which case it is an
in-place op whose output shares its input's storage. The input batch is built in
``net.input_dtype`` when the network has one (the lean runtime feeds bf16/fp16 batches); a
pass-through gradient (add, view) whose input has another dtype is a new cast buffer.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from edgetl.errors import CapabilityError
from edgetl.cost import LayerCost, numel as _numel
from edgetl.memory.leaf import measured_cost
from edgetl.models.lean.layout import is_channels_last


def stock_cost(module: nn.Module, *, in_shape, out_shape, act_bytes: int,
               input_requires_grad: bool, output_requires_grad: bool,
               in_bytes: int | None = None) -> LayerCost:
    """The rule table for stock torch leaf modules (see the module docstring)."""
    nx = _numel(in_shape) * act_bytes
    grad = output_requires_grad
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return LayerCost(saves_input=grad)
    if isinstance(module, nn.Linear):
        return LayerCost(saves_input=grad and module.weight.requires_grad)
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm)):
        if isinstance(module, nn.GroupNorm):
            stats = 2 * in_shape[0] * module.num_groups * 4
        else:
            stats = 2 * in_shape[1] * 4 if module.training else 0
        if grad:
            return LayerCost(saves_input=True, saved_new_bytes=stats)
        return LayerCost(forward_temp_bytes=stats)
    if isinstance(module, (nn.ReLU6, nn.Hardtanh)):
        if module.inplace:
            # hardtanh_'s formula needs the original input: autograd clones it first
            return LayerCost(inplace=True, saved_new_bytes=nx if grad else 0)
        return LayerCost(saves_input=grad)
    if isinstance(module, (nn.ReLU, nn.LeakyReLU)):
        if module.inplace:
            return LayerCost(inplace=True, saves_output=grad)
        return LayerCost(saves_output=grad) if isinstance(module, nn.ReLU) else LayerCost(saves_input=grad)
    if isinstance(module, (nn.Sigmoid, nn.Tanh)):
        return LayerCost(saves_output=grad)
    if isinstance(module, (nn.Hardswish, nn.SiLU, nn.GELU, nn.Hardsigmoid)):
        if getattr(module, "inplace", False):
            return LayerCost(inplace=True, saved_new_bytes=nx if grad else 0)
        return LayerCost(saves_input=grad)
    if isinstance(module, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        return LayerCost(saves_input=grad)
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        return LayerCost(saves_input=grad, saved_new_bytes=_numel(out_shape) * 8 if grad else 0)
    if isinstance(module, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        if all(int(s) == 1 for s in out_shape[2:]):
            return LayerCost()  # lowered to mean(): saves only sizes
        return LayerCost(saves_input=grad)
    if isinstance(module, (nn.Dropout, nn.Dropout2d, nn.Dropout1d)):
        if module.training and module.p > 0:
            mask = nx if not isinstance(module, (nn.Dropout1d, nn.Dropout2d)) else (
                _numel(in_shape[:2]) * act_bytes)
            return LayerCost(saved_new_bytes=mask) if grad else LayerCost(forward_temp_bytes=mask)
        return LayerCost(inplace=True, grad_input=False)
    if isinstance(module, (nn.Flatten, nn.Identity)):
        return LayerCost(inplace=True, grad_input=False)
    if isinstance(module, nn.Upsample) or type(module).__name__ == "Resize":
        return LayerCost()  # upsample_*_backward needs only sizes
    raise CapabilityError(
        f"the runtime accounting has no rule for torch's layer {type(module).__name__}: add one to "
        f"edgetl.memory.rules.stock_cost")


def layer_cost(module: nn.Module, *, in_dtype, in_channels_last: bool = False, **kwargs) -> LayerCost:
    """The stock rule table for torch's own layers (and the side network's ``Resize``, a
    bilinear interpolation to a size given at call time); any other leaf measured on meta, on
    an input laid out as the traced one (``in_channels_last``)."""
    if _tabled(module):
        return stock_cost(module, **kwargs)
    return measured_cost(module, in_shape=kwargs["in_shape"], in_dtype=in_dtype,
                         input_requires_grad=kwargs["input_requires_grad"],
                         output_requires_grad=kwargs["output_requires_grad"], in_channels_last=in_channels_last)


def _tabled(module: nn.Module) -> bool:
    """Whether the stock table describes this leaf: a layer of torch's own class (not a
    subclass defined elsewhere, whose forward may allocate differently), or ``Resize``."""
    kind = type(module)
    return kind.__module__.split(".")[0] == "torch" or (kind.__name__ == "Resize" and kind.__module__ == "edgetl.models.side")


def predicted_saved_bytes(model: nn.Module, run: Callable[[], object]) -> dict[str, int]:
    """Run ``run()`` (a forward of ``model``) and sum, per leaf that is not one of torch's own
    layers (the lean layers), the bytes its measured cost says it keeps for backward: the new
    storage it saves (``saved_new_bytes``) plus its input's or its output's storage where it
    keeps them by reference. Counted for calls whose output needs grad; a module called
    several times is summed. Returns module name -> predicted bytes, to compare with what
    ``edgetl.models.lean.count_saved_bytes`` sees saved on a real run.
    """
    out: dict[str, int] = {}

    def hook(name):
        def fn(module, args, output):
            if not (torch.is_grad_enabled() and output.requires_grad):
                return
            x = next(a for a in args if isinstance(a, torch.Tensor))
            cost = measured_cost(module, in_shape=tuple(x.shape), in_dtype=x.dtype,
                                 input_requires_grad=x.requires_grad, output_requires_grad=True,
                                 in_channels_last=is_channels_last(x))
            kept = cost.saved_new_bytes
            kept += x.untyped_storage().nbytes() if cost.saves_input else 0
            kept += output.untyped_storage().nbytes() if cost.saves_output and not cost.inplace else 0
            out[name] = out.get(name, 0) + kept

        return fn

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()
               if not any(module.children()) and not _tabled(module)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return out
