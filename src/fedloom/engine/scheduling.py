"""Splitting a round's clients into contiguous groups of about equal work (local steps), one
group per worker process or Ray actor."""

from __future__ import annotations


def balanced_groups(weights: list[int], groups: int) -> list[range]:
    """Split ``range(len(weights))`` into ``min(groups, len(weights))`` contiguous non-empty
    ranges whose largest weight sum is as small as possible."""
    n = len(weights)
    k = min(groups, n)
    if k == 0:
        return []

    def count(cap: int) -> int:
        used, total = 1, 0
        for w in weights:
            if total + w > cap:
                used, total = used + 1, 0
            total += w
        return used

    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if count(mid) <= k:
            hi = mid
        else:
            lo = mid + 1
    out: list[range] = []
    start, total = 0, 0
    for i, w in enumerate(weights):
        # close the current group at i if it would overflow, or if the tasks left are just
        # enough to give each remaining group one
        if i > start and (total + w > lo or n - i == k - len(out) - 1):
            out.append(range(start, i))
            start, total = i, 0
        total += w
    out.append(range(start, n))
    return out
