"""Clipping, stochastic quantisation to Z_{2^32} and decoding of sums
(privacy_secagg.md, section 4, Group and quantisation)."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.secure.base import SecureAggregationConfigError
from fedloom.secure.quantize import check_capacity, dequantize_sum, levels, quantize, step


def test_decoded_sum_within_one_level_per_client() -> None:
    n, d, clip, bits = 20, 10_000, 8.0, 22
    rng = np.random.default_rng(0)
    vectors = [rng.normal(scale=5.0, size=d) for _ in range(n)]  # some beyond the clip
    total = np.zeros(d, dtype=np.uint32)
    for client, x in enumerate(vectors):
        total += quantize(x, clip, bits, np.random.default_rng(client))
    decoded = dequantize_sum(total, clip, bits, n)
    exact = sum(np.clip(x, -clip, clip) for x in vectors)
    assert np.max(np.abs(decoded - exact)) <= n * step(clip, bits)


def test_levels_cover_the_clip_range() -> None:
    clip, bits = 2.0, 10
    x = np.array([-5.0, -2.0, 0.0, 2.0, 7.0])
    q = quantize(x, clip, bits, np.random.default_rng(0))
    assert q.dtype == np.uint32
    assert q[0] == q[1] == 0
    assert q[3] == q[4] == levels(bits)
    assert abs(int(q[2]) - levels(bits) / 2) <= 0.5


def test_stochastic_rounding_is_unbiased() -> None:
    clip, bits, d = 1.0, 4, 200_000
    x = np.full(d, 0.1)  # (0.1 + 1) * 15 / 2 = 8.25 levels: 8 or 9, 9 with probability 1/4
    q = quantize(x, clip, bits, np.random.default_rng(3))
    assert set(np.unique(q)) == {8, 9}
    standard_error = np.sqrt(0.25 * 0.75 / d)
    assert abs(q.mean() - 8.25) < 5 * standard_error
    decoded_mean = dequantize_sum(np.array([q.sum(dtype=np.uint64)]), clip, bits, d)[0] / d
    assert abs(decoded_mean - 0.1) < 5 * standard_error * step(clip, bits)


def test_same_stream_same_rounding() -> None:
    x = np.random.default_rng(0).normal(size=1000)
    first = quantize(x, 8.0, 22, np.random.default_rng(5))
    assert np.array_equal(first, quantize(x, 8.0, 22, np.random.default_rng(5)))
    assert not np.array_equal(first, quantize(x, 8.0, 22, np.random.default_rng(6)))


def test_overflow_guard() -> None:
    check_capacity(8.0, 22, 1000)
    check_capacity(8.0, 22, 1024)  # 1024 (2^22 - 1) = 2^32 - 1024 < 2^32
    with pytest.raises(SecureAggregationConfigError, match="overflows 2\\^32"):
        check_capacity(8.0, 22, 1025)
    with pytest.raises(SecureAggregationConfigError, match="at most 512 clients"):
        check_capacity(8.0, 23, 1000)
    with pytest.raises(SecureAggregationConfigError, match="bits"):
        check_capacity(8.0, 32, 1)
    with pytest.raises(SecureAggregationConfigError, match="clip"):
        check_capacity(0.0, 22, 10)


def test_non_finite_input_is_refused() -> None:
    with pytest.raises(ValueError, match="NaN"):
        quantize(np.array([0.0, np.nan]), 8.0, 22, np.random.default_rng(0))
