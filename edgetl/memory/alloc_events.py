"""The second instrument (issue #42 item 4): a callable in, the CPU allocator's own allocations and frees over its run out.

The storage meter (``edgetl.memory.meter``) counts what a ``TorchDispatchMode`` sees: the
storage of every tensor an aten op returns. It cannot see what happens inside a kernel,
nor a tensor made where no op dispatches. This module asks the allocator instead. With
``torch.profiler.profile(profile_memory=True)`` c10's CPU allocator reports every
allocation (its pointer and requested size) and every free to the profiler, inside the
op that made the call; ``record_allocations`` pairs them by pointer, puts them in the
order they happened and names for each the op the meter would have seen running then.

What the events see: every block the CPU allocator (``c10::GetCPUAllocator``) hands out
while the callable runs, at its requested size: tensors' storages, a kernel's intermediate
tensors (``at::empty`` inside a kernel: batch norm's per-channel sums), oneDNN's blocked
copies and scratchpads (PyTorch points ideep's allocator at c10's), and their frees.

What they do not see:
  * blocks allocated before the run (the network's weights and buffers): the allocator
    reports a free only for blocks it saw allocated, so they are neither counted nor
    subtracted; ``measure_allocator_memory`` adds them back as ``baseline_bytes``, counted
    from the tensors;
  * memory that does not come from c10's allocator: a library's own ``malloc`` (OpenMP's
    runtime), Python objects, the profiler's own records;
  * the bytes the allocator adds: ``alloc_cpu`` aligns each block to 64 bytes, and the
    events give the requested size, so they match the meter's ``storage.nbytes()``;
  * on OpenMP worker threads, whatever the profiler's thread-local state does not reach
    (with one thread everything runs on the caller's).

Each block is of one kind (``Allocation.kind``): "scratch" when it is freed before the op
that made it returns, the op being the one the meter sees (the outermost aten op without a
CompositeImplicitAutograd kernel: those decompose above the dispatch mode, so the meter sees
the ops they call); "wrapped" when no op made it (a Python number wrapped for a Tensor
argument); "tensor" otherwise: an op's output, which the meter counts. So
``peak_bytes(("tensor",))`` plus the baseline is the meter's peak (tests/test_second_instrument.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from edgetl.errors import ConfigError
from edgetl.step import Step, resolve_step, set_train_mode, training_step

log = logging.getLogger(__name__)

T = TypeVar("T")


KINDS = ("tensor", "scratch", "wrapped")


@dataclass(frozen=True)
class Allocation:
    """One block the CPU allocator handed out during the run.

    Attributes:
        nbytes: the requested size (what ``storage.nbytes()`` reports for a tensor's block).
        kind: "tensor": it outlived the op that made it (an op's output: the meter counts it);
            "scratch": freed before that op returned, so it never was a tensor outside one
            kernel; "wrapped": made outside any op, where torch's Python binding wraps a
            number passed for a Tensor argument (``x.mul(2.0)``) in a 0-dim tensor, an
            argument the meter never sees as an op's output.
        op: the op the meter sees running when the block was allocated (see the module
            docstring); "" outside any aten op.
        kernel: the innermost op that asked for it (``aten::empty``, ``aten::mkldnn_convolution``...).
        op_shapes: sizes of ``op``'s tensor arguments (None for the others).
        call: which call of ``op`` in the run (0: the first), as the meter's dispatch mode
            would count its calls; -1 outside any op.
        freed: freed before the run ended.
    """

    nbytes: int
    kind: str
    op: str
    kernel: str
    op_shapes: tuple
    call: int
    freed: bool


@dataclass
class AllocatorEvents:
    """Allocations and frees in order: ``timeline`` holds (allocation index, +1 allocated /
    -1 freed) pairs; ``allocations`` the blocks themselves."""

    allocations: list[Allocation]
    timeline: list[tuple[int, int]] = field(repr=False)

    def live_bytes(self, kinds: tuple[str, ...] = KINDS) -> list[int]:
        """Bytes live after each event, counting the blocks of ``kinds`` allocated in the run."""
        live, out = 0, []
        for index, sign in self.timeline:
            a = self.allocations[index]
            if a.kind in kinds:
                live += sign * a.nbytes
            out.append(live)
        return out

    def peak_bytes(self, kinds: tuple[str, ...] = KINDS) -> int:
        """Most bytes of ``kinds`` live at once among the blocks allocated in the run."""
        return max(self.live_bytes(kinds), default=0)

    def peak_index(self, kinds: tuple[str, ...] = KINDS) -> int:
        """The position in ``timeline`` of the first event that reaches that peak."""
        live = self.live_bytes(kinds)
        return live.index(max(live)) if live else -1

    def live_at(self, position: int) -> list[Allocation]:
        """The blocks (allocated in the run) live just after event ``position``."""
        live: dict[int, Allocation] = {}
        for index, sign in self.timeline[:position + 1]:
            if sign > 0:
                live[index] = self.allocations[index]
            else:
                live.pop(index, None)
        return list(live.values())


def _is_composite(node: Any, cache: dict[tuple[str, int], bool]) -> bool:
    """Whether op ``node`` decomposes above the dispatch mode (the meter then sees the ops it
    calls). The profiler names no overload: the candidates are the overloads (out= variants
    aside) with as many arguments as the call had, and it counts as composite only if every
    candidate is CompositeImplicitAutograd (``var_mean(x, dim, correction=0)`` may be the
    composite ``dim`` overload or the ``correction`` one, which has a kernel: the meter's op)."""
    key = (node.name, len(node.extra_fields.inputs))
    hit = cache.get(key)
    if hit is None:
        namespace, _, name = node.name.partition("::")
        packet = getattr(getattr(torch.ops, namespace, None), name, None) if name else None
        hit = False
        if packet is not None:
            composite_of: dict[Any, bool] = {}
            for o in packet.overloads():
                if "out" in o:
                    continue
                try:  # TorchScript-only overloads (``to.prim_Device``) are not in the dispatcher
                    composite_of[getattr(packet, o)] = torch._C._dispatch_has_kernel_for_dispatch_key(
                        getattr(packet, o).name(), "CompositeImplicitAutograd")
                except RuntimeError:
                    pass
            fits = [o for o in composite_of if len(o._schema.arguments) == key[1]] or list(composite_of)
            hit = bool(fits) and all(composite_of[o] for o in fits)
        cache[key] = hit
    return hit


def _shapes(node: Any) -> tuple:
    """The sizes of the tensors ``node`` (an op) took, None for other arguments."""
    if node is None:
        return ()
    return tuple(tuple(i.sizes) if hasattr(i, "sizes") else None for i in node.extra_fields.inputs)


def record_allocations(run: Callable[[], T]) -> tuple[T, AllocatorEvents]:
    """Run ``run()`` under torch's profiler with memory events; returns its result and the
    CPU allocator's allocations and frees over it (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        result = run()
    # (time, order seen, pointer, bytes (negative: a free), the ops around it, outermost first)
    raw: list[tuple[int, int, int, int, tuple]] = []

    def walk(node: Any, stack: tuple) -> None:
        if node.tag == torch._C._profiler._EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu":
                raw.append((node.start_time_ns, len(raw), f.ptr, f.alloc_size, stack))
            return
        stack = (*stack, node)
        for child in node.children:
            walk(child, stack)

    roots = prof.profiler.kineto_results.experimental_event_tree()
    for root in roots:
        walk(root, ())
    raw.sort(key=lambda r: (r[0], r[1]))

    composite: dict[tuple[str, int], bool] = {}
    calls: dict[str, list] = {}  # op name -> its meter-level calls, then numbered in time order

    def meter_ops(node: Any) -> None:
        if node.name.startswith("aten::") and not _is_composite(node, composite):
            calls.setdefault(node.name, []).append(node)
            return
        for child in node.children:
            if child.tag != torch._C._profiler._EventType.Allocation:
                meter_ops(child)

    for root in roots:
        meter_ops(root)
    ordinal = {id(n): i for nodes in calls.values()
               for i, n in enumerate(sorted(nodes, key=lambda n: n.start_time_ns))}
    open_: dict[int, tuple[int, Any]] = {}  # pointer -> (allocation index, its meter-level op)
    fields: list[dict] = []
    timeline: list[tuple[int, int]] = []
    for _, _, ptr, nbytes, stack in raw:
        if nbytes > 0:
            op = next((n for n in stack if n.name.startswith("aten::") and not _is_composite(n, composite)), None)
            index = len(fields)
            fields.append(dict(nbytes=nbytes, kind="tensor" if op is not None else "wrapped",
                               op=op.name if op is not None else "", kernel=stack[-1].name if stack else "",
                               op_shapes=_shapes(op), call=ordinal[id(op)] if op is not None else -1,
                               freed=False))
            open_[ptr] = (index, op)
            timeline.append((index, 1))
        elif nbytes < 0:
            index, op = open_.pop(ptr)
            fields[index]["freed"] = True
            if op is not None and any(n is op for n in stack):  # that very op call still runs
                fields[index]["kind"] = "scratch"
            timeline.append((index, -1))
    events = AllocatorEvents([Allocation(**f) for f in fields], timeline)
    log.debug("%d allocations, peak %d B", len(events.allocations), events.peak_bytes())
    return result, events


@dataclass
class AllocatorMemory:
    """Peak bytes of a training run according to the CPU allocator's events.

    Attributes:
        baseline_bytes: the network's params, buffers and existing grads, allocated before
            the run (the events cannot see them): distinct storages, counted from the tensors.
        events: the allocations and frees of the run (the batch, the optimizer state, every
            activation, gradient and kernel scratch).
    """

    baseline_bytes: int
    events: AllocatorEvents = field(repr=False)

    @property
    def peak_bytes(self) -> int:
        """Peak of everything the allocator handed out, weights included."""
        return self.baseline_bytes + self.events.peak_bytes()

    @property
    def tensor_peak_bytes(self) -> int:
        """The same peak counting only blocks that became tensors: what the storage meter sees."""
        return self.baseline_bytes + self.events.peak_bytes(("tensor",))


def measure_allocator_memory(net: nn.Module, *, resolution: int, batch_size: int, steps: int = 2,
                             step: Step | None = None, seed: int = 0) -> AllocatorMemory:
    """``steps`` training steps of ``net`` on CPU, as ``edgetl.memory.meter.measure_training_memory``
    runs them (the same random batch and labels for ``seed``, the same step), with no dispatch
    mode: the allocator's events only. The weights change, as they do under the meter."""
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    device = next(net.parameters()).device
    if device.type != "cpu":
        raise ConfigError(f"the allocator events are the CPU allocator's; net is on {device}")
    from edgetl.memory.meter import random_batch

    step = resolve_step(step)
    if step.ddp:
        raise ConfigError("the allocator events measure one process; step.ddp is not supported here")
    for p in net.parameters():  # as the meter's measurement does, before it counts anything
        if p.requires_grad:
            p.grad = None
    storages: dict[int, int] = {}
    for t in [*net.parameters(), *(p.grad for p in net.parameters() if p.grad is not None), *net.buffers()]:
        if t.layout == torch.strided:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()

    def run() -> None:
        # the batch as the meter's measurement draws it, allocated inside the run as there
        opt = step.optimizer(net)
        set_train_mode(net, step.bn)
        image, labels = random_batch(net, resolution=resolution, batch_size=batch_size, seed=seed, device=device)
        for _ in range(steps):
            training_step(net, step, opt, image, labels)

    _, events = record_allocations(run)
    return AllocatorMemory(sum(storages.values()), events)
