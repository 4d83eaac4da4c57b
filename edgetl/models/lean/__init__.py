"""Lean runtime layers: stock conv/BN/ReLU(6)/max-pool modules and blocks in, modules that save only what backward needs out.

DESIGN 4. Every layer here is a ``torch.autograd.Function`` whose forward is exact and
whose saved-for-backward tensors are chosen by hand:

    module              saved for backward (when a backward through it is needed)
    PooledConv2d        its input average-pooled by k (k=1: the exact input); small maps
                        pool less or not at all (effective_pool)
    LeanAvgPool2d       nothing (only the input shape)
    LeanGlobalAvgPool   nothing
    FrozenConvBNAct     fold / eval BN: a 1-bit ReLU6 / ReLU mask (nothing without
                        activation); batch BN in training: the conv output + per-channel
                        mean, invstd
    LeanReLU            a 1-bit mask (in place on a tensor nothing else saved)
    LeanMaxPool2d       each output's offset in its window: 4 bits (3x3), two a byte
    LeanResidualBlock   nothing itself (its convs and activation keep what they keep; the
                        in-place add saves nothing)
    LeanSideTail        BN1's input + per-channel batch stats (conv2's input, the ReLU
                        mask and BN2's input are recomputed in backward)

What a lean module saves is not written a second time beside it: the runtime accounting
measures it (below), ``edgetl.memory.rules.predicted_saved_bytes`` sums those measurements
over a real forward, and ``count_saved_bytes`` counts what that forward really saved with
``saved_tensors_hooks``; tests check the two against each other and against the table above.

Runtime accounting: a lean leaf describes nothing. What it keeps and its largest
forward and backward temporaries (dequantised weights, cast copies, mask construction,
per-sample masked gradients, upsampled pooled inputs) are measured by running it on a meta
twin under the storage meter (``edgetl.memory.leaf``), keyed by everything that can change
what it allocates (its settings, tensors' shapes and dtypes, the input). A leaf's state must
therefore be plain values, tensors, modules or plain objects. Its loops over samples or
chunks run through ``edgetl.cost.repeated``, so measuring a batch of hundreds takes
as long as a batch of two. tests/test_leaf.py checks each leaf's measurement against the
layer run for real. tests/test_lean_runtime.py and tests/test_moments.py check the whole step,
and each leaf's moments, against the meter on a real step to the byte.

Rooms, by concern (import from this package; the submodules are its layout):

    masks         1-bit masks: pack_mask, unpack_mask, unpack_as, mask_bytes
    fused         the same masks packed and applied by compiled kernels, one each way
                  (LeanOptions.mask_kernels "fused"; CPU; set_mask_kernels)
    layout        channels-last or plain: every layer keeps the layout it is given
                  (is_channels_last, empty_as, memory_flat)
    pooled_conv   PooledConv2d and its pooled-input gradient (effective_pool, POOLS)
    pooling       pooling that saves nothing: LeanAvgPool2d, InputNorm, ImagePool,
                  LeanGlobalAvgPool
    frozen        FrozenConvBNAct, its autograd Function, int8 weights and mask helpers
    act           LeanReLU (LeanReLU6): masked ReLU in place
    maxpool       LeanMaxPool2d
    residual      LeanResidualBlock (torchvision BasicBlock / Bottleneck in lean form)
    leanify       converters by block type (``register_converter``) and leanify_backbone:
                  a built EdgeNet's frozen features to lean layers
    saved         measuring: count_saved_bytes
"""

from edgetl.models.lean.act import LeanReLU, LeanReLU6
from edgetl.models.lean.frozen import (
    ACT_UPPER,
    DEQUANT_CHUNK,
    FrozenConvBNAct,
    check_act,
    mask_backward_per_sample,
    mask_forward_chunked,
    quantize_int8,
)
from edgetl.models.lean.leanify import (
    ACT_DTYPES,
    BN_MODES,
    WEIGHT_DTYPES,
    LeanMake,
    check_act_dtype,
    lean_block,
    leanify_backbone,
    register_converter,
    set_mask_kernels,
)
from edgetl.models.lean.masks import (
    mask_bytes,
    pack_mask,
    pack_mask_,
    unpack_as,
    unpack_mask,
    unpack_table,
)
from edgetl.models.lean.pooled_conv import (
    MIN_POOLED_SIDE,
    POOLS,
    PooledConv2d,
    effective_pool,
    grad_weight_cosine,
    inflate_saved,
    pool_for_save,
    pooled_grad_weight,
)
from edgetl.models.lean.maxpool import LeanMaxPool2d
from edgetl.models.lean.pooling import ImagePool, InputNorm, LeanAvgPool2d, LeanGlobalAvgPool, by_micro_batch
from edgetl.models.lean.residual import LeanResidualBlock
from edgetl.models.lean.saved import SavedBytes, count_saved_bytes

# a private helper that edgetl.models.lean_side imports from here
from edgetl.models.lean.pooled_conv import _check_pool

__all__ = [
    "ACT_DTYPES",
    "ACT_UPPER",
    "BN_MODES",
    "DEQUANT_CHUNK",
    "FrozenConvBNAct",
    "ImagePool",
    "InputNorm",
    "LeanAvgPool2d",
    "LeanGlobalAvgPool",
    "LeanMake",
    "LeanMaxPool2d",
    "LeanReLU",
    "LeanReLU6",
    "LeanResidualBlock",
    "MIN_POOLED_SIDE",
    "POOLS",
    "PooledConv2d",
    "SavedBytes",
    "WEIGHT_DTYPES",
    "by_micro_batch",
    "check_act",
    "check_act_dtype",
    "count_saved_bytes",
    "effective_pool",
    "grad_weight_cosine",
    "inflate_saved",
    "lean_block",
    "leanify_backbone",
    "mask_backward_per_sample",
    "mask_bytes",
    "mask_forward_chunked",
    "pack_mask",
    "pack_mask_",
    "pool_for_save",
    "pooled_grad_weight",
    "quantize_int8",
    "register_converter",
    "set_mask_kernels",
    "unpack_as",
    "unpack_mask",
    "unpack_table",
]
