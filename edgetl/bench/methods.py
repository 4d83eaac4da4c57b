"""The bench's methods: a method name in, its network (stock or lean, pruned or not, checkpointed)
out; the paper's pruning and edgetl plan's pick among them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import edgetl.models.archs as archs
from edgetl.errors import ConfigError
from edgetl.models.backbone import PAPER_RATIOS, BackboneSpec, EdgeNet, build_backbone, hidden_channels
from edgetl.models.side import LeanOptions, build_network

# The FMEC paper's pruning ratios for MobileNetV2's blocks 1-4 (DESIGN 5); at width 1.0 they
# keep 22/21/77/77 hidden channels. Another architecture's are its entry's ``paper_ratios``.
PAPER_PRUNING = PAPER_RATIOS
DEFAULT_ARCH = archs.DEFAULT_ARCH
REFERENCE = "repnet-stock"
PLAN = "plan"
FROZEN_BITS = 8  # paper accounting: frozen weights stored 8-bit (DESIGN 2a)


@dataclass(frozen=True)
class Method:
    """One row of the table: what trains, on which runtime, on which backbone."""

    name: str
    label: str
    mode: str
    lean: LeanOptions | None = None  # None: stock torch modules
    pruned: bool = False
    checkpoint: bool = False  # torch.utils.checkpoint over every features block
    planned: bool = False  # storage and pruning come from ``edgetl.plan.plan`` for the budget
    hidden: dict[int, int] | None = None  # explicit kept hidden channels (a plan's pruning)
    unstreamed: str | None = None  # the same row without streaming (a speed ratio against it)
    # stock modules run channels-last (weights and batch converted, as an expert runs stock
    # PyTorch on a CPU); a lean row says so in its options (LeanOptions.channels_last)
    channels_last: bool = False


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("full", "full fine-tune", "full"),
    Method("full-ckpt", "full fine-tune + gradient checkpointing", "full", checkpoint=True),
    Method("full-lean", "full fine-tune, lean (BN folded), exact storage", "full", LeanOptions(storage="exact")),
    Method("full-lean-pool2", "full lean + conv inputs pooled k=2 (Barley & Froening)", "full",
           LeanOptions(storage="pool2")),
    *(Method(f"full-lean-{c}", f"full lean + {label}, 10 % kept (Vu et al.)", "full",
             LeanOptions(storage=c, keep=0.1))
      for c, label in (("haar", "Haar wavelet"), ("db3", "Daubechies-3 wavelet"), ("dct", "8x8 block DCT"),
                       ("threshold", "thresholding"))),
    Method("last", "last layer", "last"),
    Method("bias", "bias only (TinyTL-B)", "bias"),
    Method("bias-lean", "bias only (TinyTL-B), lean runtime", "bias", LeanOptions(pool=1)),
    Method("bias-lean-stream", "TinyTL-B, lean, streamed by 1, uint8 batch, recompute", "bias",
           LeanOptions(pool=1, stream=1, uint8_input=True, recompute=True), unstreamed="bias-lean"),
    Method(REFERENCE, "Rep-Net, stock modules", "repnet"),
    Method("repnet-lean", "Rep-Net, lean runtime", "repnet", LeanOptions(pool=1)),
    Method("repnet-lean-stream", "Rep-Net, lean, backbone streamed by 1, uint8 batch", "repnet",
           LeanOptions(pool=1, stream=1, uint8_input=True), unstreamed="repnet-lean"),
    Method("repnet-pruned", "Rep-Net, lean, pruned backbone", "repnet", LeanOptions(pool=1), pruned=True),
    Method("repnet-pruned-pool2", "+ pooled storage k=2", "repnet", LeanOptions(pool=2), pruned=True),
    Method("repnet-pruned-pool2-bf16-int8", "+ bf16 activations, int8 frozen weights", "repnet",
           LeanOptions(pool=2, precision="bf16", frozen_weights="int8"), pruned=True),
    Method("repnet-pruned-pool2-bf16-int8-stream", "+ backbone streamed by 1, uint8 batch, recompute", "repnet",
           LeanOptions(pool=2, precision="bf16", frozen_weights="int8", stream=1, uint8_input=True,
                       recompute=True), pruned=True, unstreamed="repnet-pruned-pool2-bf16-int8"),
    Method("repnet-stock-cl", "Rep-Net, stock modules, channels-last", "repnet", channels_last=True),
    Method("repnet-lean-cl", "Rep-Net, lean runtime, channels-last", "repnet", LeanOptions(pool=1, channels_last=True)),
    Method("repnet-pruned-pool2-cl", "Rep-Net, lean, pruned, k=2 (the paper's configuration), channels-last", "repnet",
           LeanOptions(pool=2, channels_last=True), pruned=True),
    # edgetl's fused mask kernels (edgetl.models.lean.fused)
    Method("repnet-lean-cl-fused", "Rep-Net, lean runtime, channels-last, fused mask kernels", "repnet",
           LeanOptions(pool=1, channels_last=True, mask_kernels="fused")),
    Method("repnet-pruned-pool2-bf16-int8-fused", "+ bf16 activations, int8 frozen weights, fused mask kernels",
           "repnet", LeanOptions(pool=2, precision="bf16", frozen_weights="int8", mask_kernels="fused"), pruned=True),
    Method("repnet-pruned-pool2-bf16-int8-stream-fused", "+ backbone streamed by 1, uint8 batch, recompute, fused mask "
           "kernels", "repnet", LeanOptions(pool=2, precision="bf16", frozen_weights="int8", stream=1, uint8_input=True,
                                            recompute=True, mask_kernels="fused"),
           pruned=True, unstreamed="repnet-pruned-pool2-bf16-int8-fused"),
    Method(PLAN, "edgetl plan's pick for the budget", "repnet", planned=True),
)}


def plan_available() -> bool:
    """Whether the plan stage (edgetl.plan) is installed; without it the ``plan`` row is left out."""
    import importlib.util

    return importlib.util.find_spec("edgetl.plan") is not None


def fused_kernels(method: Method) -> bool:
    """Whether the method runs edgetl's fused mask kernels (compiled on first use)."""
    return method.lean is not None and method.lean.mask_kernels == "fused"


def default_methods(arch: str = DEFAULT_ARCH, device: str | torch.device = "cpu") -> list[str]:
    """Every method, less ``plan`` where edgetl.plan is missing, the paper-pruned rows on an
    architecture no paper pruned (``Architecture.paper_ratios`` empty), and the fused-kernel rows
    (``fused_kernels``) but on a CPU that can build them (a C++ compiler and ninja): on CUDA they
    are benched by name."""
    from edgetl.models.lean.fused import buildable

    ratios = bool(archs.get(arch).paper_ratios)
    fused = torch.device(device).type == "cpu" and buildable()
    return [n for n in METHODS if (n != PLAN or plan_available()) and (ratios or not METHODS[n].pruned)
            and (fused or not fused_kernels(METHODS[n]))]


def check_methods(names: list[str], arch: str, device: str | torch.device = "cpu") -> None:
    """Refuse, in one line, paper-pruned rows on an architecture without the paper's ratios, and
    fused-kernel rows on a device that has no such kernels (``edgetl.models.lean.fused.check_device``)."""
    if any(fused_kernels(METHODS[n]) for n in names):
        from edgetl.models.lean.fused import check_device

        check_device(device)
    entry = archs.get(arch)
    pruned = [n for n in names if METHODS[n].pruned]
    if pruned and not entry.paper_ratios:
        have = [archs.get(a).title for a in archs.registered() if archs.get(a).paper_ratios]
        raise ConfigError(f"method(s) {', '.join(pruned)} prune by a paper's ratios, and {entry.title} has none "
                          f"(a paper pruned {', '.join(have) or 'no registered architecture'}); leave them out, "
                          f"or bench {PLAN!r}, which prunes by its own search")


def planned_method(*, budget_bytes: int, batch_size: int, resolution: int, num_classes: int,
                   width: float, arch: str = DEFAULT_ARCH) -> tuple[Method, str]:
    """The configuration ``edgetl plan`` picks for the budget at this batch, as a Method."""
    try:
        from edgetl.plan import plan
    except ImportError as exc:
        raise ConfigError(f"method {PLAN!r} needs the plan stage (edgetl.plan): {exc}") from None
    chosen = plan(budget_bytes=budget_bytes, batch_size=batch_size, resolution=resolution,
                  num_classes=num_classes,
                  backbone=BackboneSpec(arch=arch, width=width, num_classes=num_classes)).chosen
    method = Method(PLAN, METHODS[PLAN].label, chosen.mode, chosen.lean, pruned=bool(chosen.kept),
                    planned=True, hidden=dict(chosen.kept))
    return method, f"plan: {chosen.describe()}"



# ----------------------------------------------------------------------------- building


def pruned_hidden(width: float, num_classes: int, arch: str = DEFAULT_ARCH) -> dict[int, int]:
    """Hidden channels kept by the paper's ratios of ``arch``: int(C * (1 - ratio)) (DESIGN 5)."""
    entry = archs.get(arch)
    if not entry.paper_ratios:
        raise ConfigError(f"{entry.title} has no paper ratios to keep channels by: no paper pruned it")
    net = build_backbone(BackboneSpec(arch=arch, width=width, num_classes=num_classes), device="meta")
    return {b: max(1, int(hidden_channels(net, b) * (1 - r))) for b, r in entry.paper_ratios.items()}


class Checkpointed(nn.Module):
    """A features block whose activations are recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(x)
        # Non-reentrant: works with inputs that do not require grad (the image) and
        # with nested autograd Functions. BN running statistics are updated twice per
        # step (forward and recompute); harmless for a memory/speed benchmark.
        return checkpoint(self.block, x, use_reentrant=False)


def build_method(method: Method, *, width: float, num_classes: int, device: str | torch.device,
                 hidden: dict[int, int] | None = None, arch: str = DEFAULT_ARCH) -> EdgeNet:
    """The network of ``method`` on ``arch``, trainability set (random weights: memory and speed only)."""
    spec = BackboneSpec(arch=arch, width=width, num_classes=num_classes, hidden=dict(hidden or {}))
    net = build_network(spec, method.mode, device=device, lean=method.lean)
    if method.channels_last:  # stock modules (a lean row's options say so: make_lean converts it)
        net.to_channels_last()
    if method.checkpoint:
        for i in range(len(net.features)):
            net.features[i] = Checkpointed(net.features[i])
    return net


def count_trainable(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters() if p.requires_grad)

