"""Paper accounting (DESIGN 2a): a traced network in, the TinyTL/Rep-Net memory model out.

Per leaf layer, with A bytes per activation element, nx input and ny output elements:

    layer        stored for backward                 temporary while it runs
    conv         nx*A if its weight trains, else 0   nx*A + ny*A / groups
    linear       nx*A if its weight trains           nx*A + ny*A
    BN / GN      nx*A only if gamma trains           nx*A
    ReLU family  nx/8 (1-bit mask) if any backward   nx*A
    sigmoid...   nx*A if any backward                nx*A
    pool, ...    0                                   0

An inverted residual block with a skip holds its input (R) while it runs. Walking
leaves in order, candidate = temp + S + R with S the stored bytes of earlier leaves;
the per-image peak is the largest candidate (paper eqs. 2, 5, 6).
"""

from __future__ import annotations

from edgetl.memory.report import BlockMemory
from edgetl.memory.trace import Leaf, Trace

ACT_BYTES = 4


def leaf_bytes(leaf: Leaf, backward: bool, act_bytes: int = ACT_BYTES) -> tuple[int, int]:
    """(stored, temporary) bytes of one leaf for one image under the paper's rules."""
    nx, ny = leaf.in_numel, leaf.out_numel
    if leaf.kind == "conv":
        stored = nx * act_bytes if leaf.weight_trainable else 0
        return stored, nx * act_bytes + ny * act_bytes // leaf.groups
    if leaf.kind == "linear":
        stored = nx * act_bytes if leaf.weight_trainable else 0
        return stored, nx * act_bytes + ny * act_bytes
    if leaf.kind == "bn":
        return (nx * act_bytes if leaf.weight_trainable else 0), nx * act_bytes
    if leaf.kind == "relu":
        return (nx // 8 if backward else 0), nx * act_bytes
    if leaf.kind == "smooth_act":
        return (nx * act_bytes if backward else 0), nx * act_bytes
    return 0, 0


def paper_blocks(trace: Trace, act_bytes: int = ACT_BYTES) -> list[BlockMemory]:
    """Per-block temporary, cumulative gradient and peak bytes for one image."""
    if trace.input_shape[0] != 1:
        raise ValueError("paper accounting walks a batch-1 trace")
    backward = trace.trainable_params > 0
    skip_bytes = {
        b.index: _numel(b.in_shape) * act_bytes for b in trace.blocks if b.has_skip
    }
    order: list[int] = []
    tmp: dict[int, int] = {}
    peak: dict[int, int] = {}
    cugrd: dict[int, int] = {}
    stored_total = 0
    for leaf in trace.leaves:
        stored, temp = leaf_bytes(leaf, backward, act_bytes)
        held = skip_bytes.get(leaf.block, 0) if leaf.part == "backbone" else 0
        if leaf.block not in tmp:
            order.append(leaf.block)
            tmp[leaf.block] = peak[leaf.block] = 0
        tmp[leaf.block] = max(tmp[leaf.block], temp)
        peak[leaf.block] = max(peak[leaf.block], temp + stored_total + held)
        stored_total += stored
        cugrd[leaf.block] = stored_total
    names = {b.index: b.name for b in trace.blocks}
    return [
        BlockMemory(index=i, name=names.get(i, str(i)), tmp_bytes=tmp[i], cugrd_bytes=cugrd[i],
                    peak_bytes=peak[i])
        for i in order
    ]


def param_bytes(trace: Trace, frozen_bits: int = 8, act_bytes: int = ACT_BYTES) -> int:
    """M_par: trainable parameters at A bytes, frozen ones at ``frozen_bits`` bits each."""
    return trace.trainable_params * act_bytes + trace.frozen_params * frozen_bits // 8


def sensitive(blocks: list[BlockMemory]) -> list[int]:
    """Blocks whose temporary memory exceeds the overall cumulative gradient memory."""
    overall = blocks[-1].cugrd_bytes
    return [b.index for b in blocks if b.tmp_bytes > overall]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
