"""The one search for "the largest n whose total fits the budget".

Used for every such question edgetl asks: the largest batch (``finetune``'s advice when a
batch is refused, ``plan --batch-size auto``, ``bench``'s largest-batch column), the
least pruning or the least degraded storage along ``plan``'s path, and the longest run of convs
inside streamed segments that convert whole weights (``edgetl.memory.schedule``). Totals must be
non-decreasing in n; under that one assumption the answer is exact, whatever the totals'
shape. A model's guess only changes how many totals are computed.
"""

from __future__ import annotations

from typing import Callable, Mapping

_SECANT_STEPS = 6  # then bisection: a convex total needs two or three


def largest_fitting(total_at: Callable[[int], int], budget: int, lo: int, hi: int,
                    guess: int | None = None) -> int:
    """Largest n in [lo, hi) with ``total_at(n) <= budget``, totals non-decreasing in n.

    ``lo`` is taken to fit (or to stand for "nothing fits") and ``hi`` not to (it may be one
    past the range). Without a guess this is a bisection. From a model's ``guess`` it gallops
    (steps 1, 2, 4, ...) towards the boundary, then bisects: about 1 + 2 log2(model error)
    totals for a good guess.
    """
    if hi - lo <= 1:
        return lo
    if guess is None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if total_at(mid) <= budget else (lo, mid)
        return lo
    probe = min(max(guess, lo + 1), hi - 1)
    up = total_at(probe) <= budget
    lo, hi = (probe, hi) if up else (lo, probe)
    step = 1
    while hi - lo > 1:
        probe = lo + step if up else hi - step
        galloping = lo < probe < hi
        if not galloping:
            probe = (lo + hi) // 2
        fits = total_at(probe) <= budget
        lo, hi = (probe, hi) if fits else (lo, probe)
        # crossed the boundary or overshot it: a step of hi never gallops again, so bisect
        step = step * 2 if galloping and fits == up else hi
    return lo


def largest_batch(total_at: Callable[[int], int], budget: int, upper: int,
                  known: Mapping[int, int] | None = None) -> tuple[int, dict[int, int]]:
    """Largest batch in [1, upper] whose total fits ``budget``; 0 if not even batch 1 fits.

    A training step's peak is the largest of a few moments, each affine in the batch, so the
    total is convex and piecewise affine. Small batches can peak in the optimizer step, so
    batches 8 and 16 are computed (while they fit) first. Then secant steps: through the two
    largest batches that fit while nothing above them is known (a convex total's secant
    overshoots), else through the nearest batches on either side of the budget (its chord
    lands at or below the answer), each fitting guess checked with the batch after it. Where
    the secants stall, a bisection finishes: exact for any non-decreasing totals. ``known``
    holds totals already computed. Returns the batch and every total computed, ``known``
    included (so the total of the batch after the answer, when in range).
    """
    seen = dict(known or {})

    def total(b: int) -> int:
        if b not in seen:
            seen[b] = total_at(b)
        return seen[b]

    def bounds() -> tuple[int, int]:
        """The largest batch known to fit, the smallest above it known not to (upper + 1: none)."""
        lo = max((b for b, t in seen.items() if 1 <= b <= upper and t <= budget), default=1)
        hi = min((b for b, t in seen.items() if lo < b <= upper and t > budget), default=upper + 1)
        return lo, hi

    if upper < 1 or total(1) > budget:
        return 0, seen
    for probe in (8, 16):
        lo, hi = bounds()
        if lo < probe < hi:
            total(probe)
    last_hi, kept, crept = None, 0, 0
    for _ in range(_SECANT_STEPS):
        lo, hi = bounds()
        if hi - lo <= 1:
            break
        kept = kept + 1 if hi == last_hi else 0
        last_hi = hi
        if hi <= upper:
            # the chord across the budget; the Illinois rule halves the far side's excess each
            # time it stays, or a convex total's chords would creep up from below
            x1, x2 = lo, hi
            t1, t2 = seen[lo], budget + (seen[hi] - budget) / 2**kept
        else:
            fitting = sorted(b for b, t in seen.items() if 1 <= b <= lo and t <= budget)
            if len(fitting) < 2:
                break
            x1, x2 = fitting[-2:]
            t1, t2 = seen[x1], seen[x2]
        flat = t2 <= t1  # no growth seen yet: try the top of the range
        guess = hi - 1 if flat else min(max(int(x1 + (budget - t1) * (x2 - x1) // (t2 - t1)), lo + 1), hi - 1)
        crept = crept + 1 if guess == lo + 1 else 0
        if guess in seen or crept > 1:
            # chords landing on the smallest step twice creep up two batches a step (a total
            # flat up to just under the budget): bisect
            break
        if total(guess) <= budget and guess + 1 < hi:
            total(guess + 1)
    lo, hi = bounds()
    return largest_fitting(total, budget, lo, hi), seen
