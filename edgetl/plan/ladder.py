"""The storage ladder: the options a plan may fix in, the storage and step levers from exact to
most saving out (``storage_ladder``), with the step and lean options a rung stands for."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from edgetl.errors import ConfigError
from edgetl.models.backbone import BackboneSpec
from edgetl.plan.document import CONV_STORAGES, HALF_DTYPES, MODE, OPTIMIZER, Storage


def plan_step(storage: Storage | None = None):
    """The training step a plan is made for, predicted and verified: Adam, no weight decay,
    no label smoothing, single-tensor updates (``edgetl.step.Step.plain``), with fused
    kernels and the update inside backward where ``storage`` takes them. No DDP, foreach or
    loss scaling, so the levers never meet what ``Step`` refuses them with. finetune's
    pre-flight predicts the recipe's own step again before training."""
    from edgetl.step import Step

    if storage is None:
        return Step.plain(OPTIMIZER)
    return Step.plain(OPTIMIZER, fused=storage.fused, step_in_backward=storage.step_in_backward)


def half_precision() -> str:
    """The dtype of "half" activations: fp16 where this machine's CPU runs fp16 convolutions, else bf16.

    Both store 2 bytes an element and cost no measured accuracy, but fp16 keeps 10 mantissa
    bits to bf16's 7: one batch's side-network gradient has cosine 0.956 (at initialisation)
    and 0.979 (after fine-tuning) to the fp32 one with fp16 activations, 0.812 and 0.880
    with bf16 (``benchmarks/levers_accuracy.md``, gradient check). fp16's narrow range
    needs no loss scaling there: scaling the loss by 1024 leaves that cosine unchanged
    (0.956, 0.979). The probe is the CPU's because ``--verify`` measures there; Orin
    (sm_87) runs both dtypes. Where the CPU lacks fp16 convolutions (older torch builds),
    bf16 is planned and the plan says so in its notes.
    """
    return _half_precision_probe()


@functools.lru_cache(maxsize=1)
def _half_precision_probe() -> str:
    import torch

    from edgetl.errors import CapabilityError
    from edgetl.models.lean import check_act_dtype

    try:
        check_act_dtype(torch.float16, "cpu")
    except CapabilityError:
        return HALF_DTYPES[1]
    return HALF_DTYPES[0]


def storage_ladder(*, pool: int | None = None, precision: str | None = None,
                   frozen_weights: str | None = None,
                   stored_pools: Callable[[int], list[int]] | None = None,
                   half: str | None = None, stream: int | None = None, mode: str = MODE,
                   fused: bool | None = None, step_in_backward: bool | None = None) -> list[Storage]:
    """Storage and step options from exact to most saving; a fixed dimension never changes.

    Rep-Net (``mode`` "repnet") as below; bias-only TinyTL-B the same without pooling (it
    has no side network); lean full fine-tuning trains every conv in fp32 with nothing
    frozen to stream or quantise, so its levers are the optimizer's two (below), then what
    each conv keeps for its weight gradient: exact, then pooled by 2, then by 4
    (``CONV_STORAGES``; the compressors store about as little as pool4 at 224 px and are
    left to the user, ``--storage``).

    Streaming by 1 (the batch kept as uint8 pixels) and recomputing streamed segments come
    first (issue #14): the same gradients up to the rounding of the frozen backbone's convs
    run on fewer samples (recomputing: bit for bit); they cost speed only. The optimizer's
    levers come next, fused kernels, then the update inside backward:

    * fused kernels (``optim.fused``) allocate nothing beyond the optimizer state and launch
      fewer kernels, but round every update of the trained weights differently (within 2e-4
      of the unfused weights after 3 steps at lr 1e-2, README "Step in backward"): after
      streaming, which only regroups the frozen backbone's arithmetic, and far below
      rounding every frozen weight to fp16's 11 bits, so before the frozen-weight levers.
    * the update inside backward (``optim.step_in_backward``) gives the same weights bit for
      bit and frees each gradient as soon as its parameter is updated, yet comes after fused
      kernels: without them each update's temporaries (single-tensor Adam: two copies of the
      parameter) land during backward, beside live activations, and can raise the peak
      (stock Rep-Net on MobileNetV2 0.35, 64 px, batch 4: 10.80 -> 11.72 MB), which the
      bisection below cannot have; with them the update allocates nothing, so freeing
      gradients early only lowers it. So it is a rung only where fused kernels are on or
      searched. It rules out DDP, foreach and fp16 loss scaling (``edgetl.step``); the
      planned step has none of them.

    ``plan`` drops either lever again where the chosen configuration fits without it
    (``_fewest_optimizer_levers``): past the levers, e.g. when pruning, the peak may be a
    forward temporary they do not touch.

    The storage levers after them go in the order of the measured accuracy cost per byte
    saved, cheapest first (``benchmarks/levers_accuracy.md``: Rep-Net fine-tuning on
    Fashion-MNIST, 3 seeds; MB saved by the runtime accounting at 224 px, batch 8; points
    lost per MB saved, negative = no measured loss):

    1. frozen weights fp16 (-1.14 points/MB, 0.76 MB saved), then 2. int8 (-0.81, 1.12 MB):
       both fine-tuned +0.9 points above fp32, within the baseline seeds' 2.2-point spread;
       they perturb only the frozen weights, not the stored activations or the gradients.
    3. half activations (``half``; default ``half_precision()``, fp16 where it runs): fp16
       -0.04, bf16 -0.00 points/MB for 16 MB saved, again no measured loss, but they round
       every stored activation and the backward through it (one batch's side-gradient
       cosine to fp32: fp16 0.96-0.98, bf16 0.81-0.88), so they come after the frozen-weight
       savings although they save far more.
    4. pooling k 2, then 4, last: it approximates the side convs' weight gradients and its
       cost is not resolved (at 64 px k=2 and k=4 store alike, and at 64 px and at 224 px,
       batch 8, the unpruned network's peak, a forward temporary, does not move).

    All of these Δ are within seed noise, so the points per MB mostly rank by bytes saved;
    the order of 1-2 before 3 before 4 also follows what each lever perturbs.

    Pruning is not a storage option; the plan prunes only past the ladder's end (without
    retraining it costs 2.5 points in the study, the one resolved loss).

    ``stored_pools(k)``, when given, says how the side convs really store their inputs for
    a requested k (small maps pool less, ``edgetl.models.lean.effective_pool``); a k that
    stores exactly as the smaller one before it is no step: it would save nothing, and the
    objective prefers the smaller k.

    ``plan`` bisects the ladder, so the predicted total must not rise along it. With fp32
    activations int8 frozen weights always hold less than fp16 ones (same fp32 dequantised
    copy), and at 224 px every dtype step saves (``tests/test_plan.py``, batch 8). It does
    not hold everywhere, in this order or the previous one (fp16, half, int8): at batch 1-4
    on small inputs (64-96 px) the int8 dequantisation buffer with half activations (an
    fp32 copy of a layer's weight plus its half cast) can outweigh what half activations
    save, and half+int8 then predicts more than a step before it.
    """
    def optimizer_steps() -> None:
        if fused is None:
            step(fused=True)
        if step_in_backward is None and fused is not False:
            step(step_in_backward=True)

    def step(**change):
        ladder.append(dataclasses.replace(ladder[-1], **change))

    first_step = dict(fused=bool(fused), step_in_backward=bool(step_in_backward))
    if mode == "full":
        ladder = [Storage(1, "fp32", "fp32", 0, CONV_STORAGES[0], **first_step)]
        optimizer_steps()
        for s in CONV_STORAGES[1:]:
            step(conv_storage=s)
        return ladder
    if mode != MODE:
        pool = 1
    if half is None:
        half = half_precision()
    if half not in HALF_DTYPES:
        raise ConfigError(f"half precision {half!r} is not allowed; allowed: {', '.join(HALF_DTYPES)}")
    p = 1 if pool is None else pool
    a = "fp32" if precision is None else precision
    w = "fp32" if frozen_weights is None else frozen_weights
    ladder = [Storage(p, a, w, stream or 0, **first_step)]

    if stream is None:  # streaming first: it costs no accuracy (issue #14), only speed
        step(stream=1)
        step(recompute=True)  # then forward again in backward where masks outweigh inputs
    optimizer_steps()  # then the optimizer's levers: see above for their order

    if frozen_weights is None:
        step(frozen_weights="fp16")
        step(frozen_weights="int8")
    if precision is None:
        step(precision=half)
    if pool is None:
        for k in (2, 4):
            if stored_pools is None or stored_pools(k) != stored_pools(ladder[-1].pool):
                step(pool=k)
    return ladder


def _stored_pools_of(spec: BackboneSpec, resolution: int) -> Callable[[int], list[int]]:
    """k -> the factor each side conv of ``spec`` stores its input with at ``resolution``."""
    from edgetl.models.lean import effective_pool
    from edgetl.models.lean_side import side_conv_sizes
    from edgetl.models.side import build_network

    sizes = side_conv_sizes(build_network(spec, MODE, device="meta"), resolution)
    return lambda k: [effective_pool(k, hw) for hw in sizes]


def _network_key(storage: Storage) -> Storage:
    """What of a storage builds the network: the optimizer's levers change only the step."""
    return dataclasses.replace(storage, fused=False, step_in_backward=False)

