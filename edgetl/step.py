"""One training step, described once: the loss, the optimizer and its settings, the train mode.

The runtime accounting (``edgetl.memory.runtime``) simulates this step, the meter
(``edgetl.memory.meter``) measures it, and ``edgetl.train.fit`` runs it: all three read
the same :class:`Step` and call the same functions below, so "reported = used" holds by
construction rather than by keeping three copies in agreement (issue #17).

A step is::

    logits = net(images)                     # train mode per ``bn`` (``set_train_mode``)
    loss = step.loss(logits, labels)         # cross-entropy, the recipe's label smoothing
    correct = (logits.argmax(1) == labels).sum()
    del logits
    loss.backward()
    optimizer.step()                         # the recipe's optimizer, foreach set explicitly
    optimizer.zero_grad(set_to_none=True)    # no gradient lives into the next forward

With ``optim.step_in_backward`` (issue #14 item 3) each parameter is updated inside
``loss.backward()`` as soon as its gradient is complete, and that gradient freed at once
(``Step.optimizer`` registers the hooks); ``optimizer.step()`` then finds no gradient
left and does nothing.

``Step.from_recipe`` takes the optimizer, its parameter groups (side / head learning
rates, weight decay, no decay for 1-d parameters where asked) and the loss from a recipe;
``Step()`` is the plain step the memory tools use when no recipe is given (Adam 1e-3,
no weight decay, no smoothing, single-tensor updates).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from edgetl.errors import ConfigError
from edgetl.options import BN_MODES
from edgetl.recipe import OptimConfig, Recipe

OPTIMIZERS = ("adam", "sgd")


def default_optim() -> OptimConfig:
    """The plain step's optimizer: Adam 1e-3, no weight decay, no smoothing, single-tensor."""
    return OptimConfig(name="adam", weight_decay=0.0, label_smoothing=0.0, schedule="constant", lr=1e-3)


@dataclass(frozen=True)
class Step:
    """What one training step runs besides the network.

    Attributes:
        optim: optimizer name, learning rates, weight decay, momentum, label smoothing and
            ``foreach`` (the recipe's ``optim`` section).
        bn: "fold": frozen BN layers stay in eval mode; "batch": every BN uses batch statistics.
        ddp: the step runs under DistributedDataParallel (``ddp_wrap``): gradients are views
            into DDP's gradient buckets, which live for the whole run (the trainable size),
            so ``zero_grad`` zeroes them instead of freeing them.
    """

    optim: OptimConfig = dataclasses.field(default_factory=default_optim)
    bn: str = "fold"
    ddp: bool = False

    def __post_init__(self) -> None:
        if self.optim.name not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optim.name!r}; allowed: {', '.join(OPTIMIZERS)}")
        if self.bn not in BN_MODES:
            raise ConfigError(f"unknown bn mode {self.bn!r}; allowed: {', '.join(BN_MODES)}")
        if self.in_backward:
            for on, what in ((self.ddp, "DDP (gradients are all-reduced in buckets after backward)"),
                             (self.optim.foreach, "optim.foreach (one parameter is updated at a time)")):
                if on:
                    raise ConfigError(f"optim.step_in_backward cannot run with {what}; allowed: one of the two")

    @property
    def in_backward(self) -> bool:
        """Whether the update runs inside backward, parameter by parameter (``step_in_backward``)."""
        return self.optim.step_in_backward

    @classmethod
    def from_recipe(cls, recipe: Recipe, *, ddp: bool = False) -> "Step":
        return cls(optim=recipe.optim, bn=recipe.model.bn, ddp=ddp)

    @classmethod
    def plain(cls, optimizer: str = "adam", lr: float = 1e-3, **changes) -> "Step":
        """The default step with another optimizer or rate (SGD: no momentum); ``changes``
        replace further ``OptimConfig`` fields (weight_decay, foreach, label_smoothing...)."""
        fields = {"name": optimizer, "lr": lr, "momentum": 0.0 if optimizer == "sgd" else None}
        optim = dataclasses.replace(default_optim(), **{**fields, **changes})
        return cls(optim=optim)

    @property
    def optimizer_name(self) -> str:
        return self.optim.name

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy with the recipe's label smoothing."""
        return F.cross_entropy(logits, labels, label_smoothing=self.optim.label_smoothing)

    def param_groups(self, model: nn.Module) -> list[dict]:
        return param_groups(model, self.optim)

    def stand_in_optimizer(self, model: nn.Module) -> tuple[torch.optim.Optimizer, dict[int, nn.Parameter]]:
        """This step's optimizer over stand-ins of ``model``'s trainable parameters (same
        groups, shapes, dtypes), and the stand-ins by original ``id``: on meta, or CPU zeros
        for fused kernels, which have no meta implementation."""
        def stand_in(p: nn.Parameter) -> nn.Parameter:
            if self.optim.fused:
                return nn.Parameter(torch.zeros_like(p, device="cpu"))
            return nn.Parameter(torch.empty_like(p, device="meta"))

        groups = self.param_groups(model)
        stand = {id(p): stand_in(p) for g in groups for p in g["params"]}
        optimizer = build_optimizer([{**g, "params": [stand[id(p)] for p in g["params"]]} for g in groups],
                                    self.optim)
        return optimizer, stand

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s trainable parameters, in this step's groups.

        With ``step_in_backward`` it is also hooked into backward (``step_in_backward``);
        the hooks of an optimizer made earlier for ``model`` are removed first.
        """
        optimizer = build_optimizer(self.param_groups(model), self.optim)
        for handle in getattr(model, "_edgetl_step_hooks", ()):
            handle.remove()
        model._edgetl_step_hooks = step_in_backward(optimizer) if self.in_backward else []
        return optimizer


def resolve_step(step: Step | None, optimizer: str | None = None, lr: float = 1e-3) -> Step:
    """``step``, or the plain step with ``optimizer`` and ``lr`` (the memory tools' shorthand);
    an ``optimizer`` that contradicts the given step is an error."""
    if step is not None and optimizer is not None and optimizer != step.optimizer_name:
        raise ConfigError(f"optimizer {optimizer!r} contradicts the step's {step.optimizer_name!r}")
    return step if step is not None else Step.plain(optimizer or "adam", lr)


def param_groups(model: nn.Module, optim: OptimConfig) -> list[dict]:
    """Trainable parameters in groups: side network (lr_side) and the rest (lr_head).

    With ``decay_norm_and_bias: false``, 1-d parameters (normalisation weights, biases)
    get no weight decay, as the torchvision references' ``--norm-weight-decay 0``.
    """
    groups: dict[tuple[str, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part = "side" if name.startswith("side.") or ".side." in name else "head"
        no_decay = not optim.decay_norm_and_bias and p.ndim <= 1
        groups.setdefault((part, no_decay), []).append(p)
    if not groups:
        raise ConfigError("the model has no trainable parameters; check model.mode")
    out = []
    for (part, no_decay), params in sorted(groups.items()):
        lr = optim.side_lr if part == "side" else optim.head_lr
        if lr is None:
            raise ConfigError("the model has side-network parameters; set optim.lr_side or optim.lr")
        out.append({
            "params": params, "lr": lr, "name": part + ("_no_decay" if no_decay else ""),
            "weight_decay": 0.0 if no_decay else optim.weight_decay,
        })
    return out


def build_optimizer(groups: list[dict], optim: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer ``optim`` names, with ``foreach`` set explicitly (PyTorch's default
    differs by device: multi-tensor on CUDA, whose temporaries are a whole group's size), or
    fused kernels (``optim.fused``)."""
    kind = dict(foreach=optim.foreach, fused=True) if optim.fused else dict(foreach=optim.foreach)
    if optim.name == "adam":
        return torch.optim.Adam(groups, weight_decay=optim.weight_decay, **kind)
    if optim.name == "sgd":
        return torch.optim.SGD(
            groups, lr=groups[0]["lr"], momentum=optim.momentum or 0.0,
            nesterov=optim.nesterov, weight_decay=optim.weight_decay, **kind,
        )
    raise ConfigError(f"unknown optimizer {optim.name!r}; allowed: {', '.join(OPTIMIZERS)}")


def step_in_backward(optimizer: torch.optim.Optimizer) -> list:
    """Update each parameter of ``optimizer`` inside backward once its gradient is complete.

    PyTorch's post-accumulate-grad hook pattern: the hook runs right after autograd has
    accumulated a parameter's gradient, when that parameter is the only one holding a
    gradient (earlier ones were freed by their hooks, later ones are not accumulated
    yet), so ``optimizer.step()`` updates exactly it, with its own group's rate and its
    own state; the gradient is then freed. One optimizer object keeps every state and
    rate, so schedulers and checkpoints work unchanged. Not for gradient accumulation or
    clipping across parameters (each update happens before the next gradient exists).
    Returns the hook handles.
    """
    def hook(p: torch.Tensor) -> None:
        optimizer.step()
        p.grad = None

    return [p.register_post_accumulate_grad_hook(hook) for g in optimizer.param_groups for p in g["params"]]


def set_train_mode(model: nn.Module, bn: str) -> None:
    """train(); with bn "fold", frozen BN layers stay in eval mode (fixed statistics, foldable)."""
    model.train()
    if bn == "fold":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None and not m.weight.requires_grad:
                m.eval()


def loss_and_correct(step: Step, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's loss and the count of top-1 hits (a 0-d tensor), from the logits."""
    loss = step.loss(logits, labels)
    correct = (logits.detach().argmax(1) == labels).sum()
    return loss, correct


def training_step(net: nn.Module, step: Step, optimizer: torch.optim.Optimizer,
                  images: torch.Tensor, labels: torch.Tensor, *,
                  autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                  scaler: torch.amp.GradScaler | None = None,
                  mix: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step as the module docstring says; returns (loss, correct), both detached 0-d tensors.

    The logits are dropped before backward and the gradients after the update, so neither
    lives longer than the step needs (the runtime accounting assumes exactly this).

    Args:
        autocast: a context factory for the forward (mixed precision on CUDA); None: none.
        scaler: a GradScaler (fp16 autocast): scales the loss, steps and updates.
        mix: (loss, logits) -> the loss to minimise (distillation mixes a teacher in).
    """
    with (autocast or contextlib.nullcontext)():
        logits = net(images)
        loss, correct = loss_and_correct(step, logits, labels)
        if mix is not None:
            loss = mix(loss, logits)
    del logits
    if scaler is not None:
        if step.in_backward:
            raise ConfigError("optim.step_in_backward cannot run with fp16 loss scaling (the scaler checks "
                              "every gradient before any update); allowed: bf16 or fp32")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    # under DDP the gradients are views into its buckets, which live anyway: freeing them
    # would only make backward allocate fresh ones beside the buckets
    optimizer.zero_grad(set_to_none=not step.ddp)
    return loss.detach(), correct


def ddp_wrap(model: nn.Module, step: Step, device: torch.device) -> nn.parallel.DistributedDataParallel:
    """``model`` in DistributedDataParallel as the step's accounting assumes (issue #17 item 7).

    * ``gradient_as_bucket_view``: each gradient is a view into DDP's flat gradient buckets
      (the trainable size, allocated once), not a second copy beside them.
    * ``broadcast_buffers`` only with ``bn="batch"``: there BN running statistics change every
      step and rank 0's are broadcast before each forward, as plain DDP does. With folded BN
      every buffer (the lean runtime's frozen weights among them) is a constant loaded
      identically on every rank; re-broadcasting it each step would cost time and a
      coalesced copy of all buffers.
    """
    if not step.ddp:
        raise ValueError("ddp_wrap needs a step with ddp=True (the accounting counts its buckets)")
    ddp = nn.parallel.DistributedDataParallel
    # newer torch names the per-forward broadcast forward_sync_buffers (both sync at init)
    sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters
            else "broadcast_buffers")
    return ddp(model, device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=True, **{sync: step.bn == "batch"})
