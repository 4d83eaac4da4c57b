"""The one largest-that-fits search, against brute force over every index."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetl.memory.search import largest_batch, largest_fitting


def brute_force(f, budget: int, upper: int) -> int:
    return max((b for b in range(1, upper + 1) if f(b) <= budget), default=0)


class Counted:
    def __init__(self, f):
        self.f, self.calls = f, []

    def __call__(self, b: int) -> int:
        self.calls.append(b)
        return self.f(b)


# a step's peak: the largest of a few moments, each affine in the batch
moments = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 300)), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(moments=moments, budget=st.integers(0, 60_000), upper=st.integers(1, 5000),
       known=st.lists(st.integers(1, 6000), max_size=3))
def test_largest_batch_of_a_peak_is_brute_force(moments, budget, upper, known):
    def f(b):
        return max(c + s * b for c, s in moments)

    total = Counted(f)
    got, seen = largest_batch(total, budget, upper, {b: f(b) for b in known})
    assert got == brute_force(f, budget, upper)
    assert all(seen[b] == f(b) for b in seen)
    assert len(set(total.calls)) == len(total.calls)  # nothing computed twice
    if got < upper and got:
        assert got + 1 in seen  # the batch after the answer is computed: the caller can show it
    assert len(total.calls) <= 16  # secants land close: about 16 would be a plain bisection


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.integers(0, 50), min_size=1, max_size=200), budget=st.integers(0, 5000),
       guess=st.one_of(st.none(), st.integers(-10, 250)))
def test_largest_fitting_of_any_monotone_totals_is_brute_force(steps, budget, guess):
    totals = list(itertools.accumulate(steps))  # non-decreasing, any shape
    hi = len(totals)
    truth = max((i for i in range(1, hi) if totals[i] <= budget), default=0)
    got = largest_fitting(lambda i: totals[i], budget, 0, hi, guess)
    assert got == truth


@pytest.mark.parametrize("flat, budget, upper, answer", [(406, 406, 31, 29), (433, 434, 33, 31)])
def test_a_flat_stretch_just_under_the_budget_does_not_stall_the_secants(flat, budget, upper, answer):
    """Found by the property above: f(b) = max(flat, 14 b) is flat up to about the budget; the
    chord from the flat side landed one batch up each step (17 totals, a bisection needs 7)."""
    total = Counted(lambda b: max(flat, 14 * b))
    got, _ = largest_batch(total, budget, upper)
    assert got == answer and len(total.calls) <= 10


def test_nothing_fits_and_the_ends():
    assert largest_batch(lambda b: 10 * b, 5, 100) == (0, {1: 10})
    assert largest_batch(lambda b: 10 * b, 10_000, 1)[0] == 1
    assert largest_batch(lambda b: 10 * b, 10_000, 0)[0] == 0
    assert largest_batch(lambda b: 10 * b, 10_000, 100)[0] == 100


def test_a_step_whose_peak_moves_from_the_weights_to_the_activations_takes_few_totals():
    """The shape the bench meets (a lean Rep-Net at 64 px: the optimizer's moment at small
    batches, activations past them): secants land in a handful of totals, not a bisection's 16."""
    def f(b):
        return max(5_440_000 + 75_000 * b, 3_700_000 + 172_000 * b)

    total = Counted(f)
    got, _ = largest_batch(total, 24_000_000, 1 << 16)
    assert got == brute_force(f, 24_000_000, 2000)
    assert len(total.calls) <= 7
