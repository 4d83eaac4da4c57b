"""StorageMeter and measure_training_peak (DESIGN 2c) against hand counts and saved_tensors_hooks."""

import pytest
import torch
from torch import nn

from edgetl.errors import ConfigError
from edgetl.memory.meter import StorageMeter, measure_training_peak

F4 = 4  # bytes per fp32 element


class LinearNet(nn.Module):
    def __init__(self, features: int, classes: int):
        super().__init__()
        self.lin = nn.Linear(features, classes)

    def forward(self, x):
        return self.lin(x.flatten(1))


def test_views_and_inplace_count_once_and_frees_subtract():
    x = torch.randn(4, 8)
    meter = StorageMeter()
    meter.register(x)
    assert meter.current_bytes == 32 * F4
    with meter:
        y = x * 2  # new storage
        v = y.view(32)  # view: same storage
        r = y.relu_()  # in-place: same storage
        assert meter.current_bytes == 2 * 32 * F4
        z = y + 1
        assert meter.current_bytes == 3 * 32 * F4
        del y, v, r, z
        assert meter.current_bytes == 32 * F4
    meter.close()
    assert meter.peak_bytes == 3 * 32 * F4


def test_register_module_counts_params_buffers_and_grads():
    net = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4))
    net[0].weight.grad = torch.zeros_like(net[0].weight)
    meter = StorageMeter()
    meter.register_module(net)
    params = (4 * 3 * 9 + 4 + 4) * F4
    buffers = 2 * 4 * F4 + 8  # running mean/var + int64 num_batches_tracked
    grads = 4 * 3 * 9 * F4
    assert meter.current_bytes == params + buffers + grads


def test_single_linear_step_by_hand():
    """params + grads + Adam state + input + labels + the two temporaries of Adam's denom
    + the loss and the hit count that the step returns (edgetl.step.training_step)."""
    batch, res, classes = 4, 2, 5
    features = 3 * res * res
    torch.manual_seed(0)
    peak = measure_training_peak(LinearNet(features, classes), resolution=res, batch_size=batch, steps=3)
    params = (features * classes + classes) * F4
    static = params + batch * features * F4 + batch * 8  # + input batch, int64 labels
    adam = 2 * params + 2 * F4  # exp_avg, exp_avg_sq, one fp32 step per tensor
    denom = 2 * features * classes * F4  # sqrt(exp_avg_sq) and its quotient, largest param
    returned = F4 + 8  # the fp32 loss and the int64 count of top-1 hits
    assert peak == static + params + adam + denom + returned == 1764


def test_single_linear_sgd_peak_is_in_backward():
    """SGD (no momentum): peak while the weight grad is produced in backward."""
    batch, res, classes = 64, 2, 5
    features = 3 * res * res
    peak = measure_training_peak(LinearNet(features, classes), resolution=res, batch_size=batch,
                                 steps=2, optimizer="sgd")
    params = (features * classes + classes) * F4
    static = params + batch * features * F4 + batch * 8
    logits = batch * classes * F4
    # log_softmax's backward: its saved output, the incoming grad and the outgoing grad
    # (three logits-sized tensors) + the loss and nll's total_weight (fp32 scalars); the
    # logits themselves were freed after the loss, grads come later; + the int64 hit count
    assert peak == static + 3 * logits + 2 * F4 + 8


def _conv_net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.AvgPool2d(2), nn.Dropout(0.5), nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4),
    )


@pytest.mark.parametrize("frozen", [False, True])
def test_meter_agrees_with_saved_tensors_hooks(frozen):
    """After a forward, live = registered + unique saved storages + the output, to the byte."""
    torch.manual_seed(0)
    net = _conv_net().train()
    net.requires_grad_(not frozen)
    x = torch.randn(2, 3, 16, 16, requires_grad=frozen)  # something must need grad
    known = {p.untyped_storage().data_ptr() for p in net.parameters()}
    known |= {b.untyped_storage().data_ptr() for b in net.buffers()}
    known.add(x.untyped_storage().data_ptr())
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in known:
            saved[st.data_ptr()] = st.nbytes()
        return t

    meter = StorageMeter()
    meter.register_module(net)
    meter.register(x)
    base = meter.current_bytes
    with meter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = net(x)
    meter.close()
    out = y.untyped_storage()
    expected = sum(saved.values()) + (0 if out.data_ptr() in saved else out.nbytes())
    assert len(saved) >= 8  # conv, BN, clone for ReLU6, ReLU result, pool, mask, ...
    assert meter.current_bytes - base == expected


def test_measure_follows_device_and_rejects_bad_input():
    net = LinearNet(12, 5)
    with pytest.raises(ConfigError, match="move it first"):
        measure_training_peak(net, resolution=2, batch_size=2, device="meta")
    with pytest.raises(ConfigError, match="optim.name is 'lion'; allowed: 'adam', 'sgd'"):
        measure_training_peak(net, resolution=2, batch_size=2, optimizer="lion")
    net.requires_grad_(False)
    with pytest.raises(ConfigError, match="nothing trains"):
        measure_training_peak(net, resolution=2, batch_size=2)


def test_measure_is_deterministic_and_scales_with_batch():
    torch.manual_seed(0)
    a = measure_training_peak(_Head(), resolution=8, batch_size=2, steps=2)
    b = measure_training_peak(_Head(), resolution=8, batch_size=2, steps=2)
    c = measure_training_peak(_Head(), resolution=8, batch_size=4, steps=2)
    assert a == b
    # at batch 2 -> 4 the activations double; params, grads and Adam state do not
    assert a < c < 2 * a


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = _conv_net()
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_uses_max_memory_allocated():
    net = LinearNet(12, 5).to("cuda")
    peak = measure_training_peak(net, resolution=2, batch_size=4, steps=3)
    # the caching allocator rounds every block up to 512 B: at least the CPU count
    assert peak >= 1752


def test_op_tensors_are_what_pytree_finds():
    """The meter's walk over an op's output and arguments (``tensors_in``) against pytree's
    ``tree_leaves``: the same tensors, in the same order, for nested tuples, lists, dicts,
    return-type tuples (``torch.return_types``) and scalars between them."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from torch.utils._pytree import tree_leaves

    from edgetl.metaop import tensors_in

    pool = [torch.zeros(i + 1) for i in range(4)]
    leaves = st.one_of(st.sampled_from(pool), st.integers(), st.floats(allow_nan=False), st.none(),
                       st.just(torch.float32), st.just(torch.Size([2, 3])))
    values = st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.tuples(inner, inner).map(lambda ab: torch.return_types.max(ab))), max_leaves=12)

    @settings(max_examples=200, deadline=None)
    @given(values)
    def check(value):
        expected = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        found = list(tensors_in(value))
        assert [id(t) for t in found] == [id(t) for t in expected]

    check()
