"""Each scheme's payload: its byte count is the real size of what it encodes, decoding gives
the tensor back where it must (fp16-representable values, top-k's kept entries), and the
random schemes are unbiased (QSGD, Lemma 3.1 of Alistarh et al. 2017; random-k scaled by d/k)."""

from __future__ import annotations

import math

import pytest
import torch

from fedloom.compression.payload import bits_for, index_dtype, pack_bits, unpack_bits
from fedloom.compression.quantize import FP16, QSGD, Int8
from fedloom.compression.sparsify import RandK, TopK, kept
from fedloom.core.rng import generator


def gen(i: int = 0) -> torch.Generator:
    return generator(0, "test/compression", client=i)


def vector(n: int = 1000, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8, 11])
def test_pack_bits_round_trip_and_size(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (1001,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(1001 * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, 1001), codes)


def test_topk_sends_the_largest_entries_exactly() -> None:
    x = vector(1000)
    scheme = TopK(0.05)
    payload = scheme.encode(x, gen())
    k = kept(1000, 0.05)
    assert k == 50
    assert payload.parts["values"].numel() == k
    assert payload.parts["indices"].dtype == torch.int16  # 1000 entries: 2-byte indices
    assert payload.nbytes == k * 4 + k * 2
    out = scheme.decode(payload, 1000, gen())
    largest = x.abs().topk(k).indices
    assert torch.equal(out[largest], x[largest])
    assert int((out != 0).sum()) == k


def test_index_dtype_widens_with_the_tensor() -> None:
    assert index_dtype(1 << 15) == torch.int16
    assert index_dtype((1 << 15) + 1) == torch.int32
    assert index_dtype((1 << 31) + 1) == torch.int64


def test_randk_sends_only_values_and_the_server_regenerates_the_indices() -> None:
    x = vector(1000)
    scheme = RandK(0.1, unbiased=False)
    payload = scheme.encode(x, gen(3))
    assert list(payload.parts) == ["values"] and payload.nbytes == 100 * 4
    out = scheme.decode(payload, 1000, gen(3))
    sent = out != 0
    assert int(sent.sum()) == 100
    assert torch.equal(out[sent], x[sent])  # same stream on both sides: the right places


@pytest.mark.parametrize("levels", [1, 4, 16])
def test_qsgd_payload_size(levels: int) -> None:
    x = vector(1000)
    payload = QSGD(levels).encode(x, gen())
    bits = bits_for(2 * levels + 1)
    assert bits == math.ceil(math.log2(2 * levels + 1))
    assert payload.nbytes == 4 + math.ceil(1000 * bits / 8)


def test_qsgd_levels_bracket_the_value() -> None:
    """Each decoded entry is one of the two levels around it (same sign)."""
    x, s = vector(500), 8
    scheme = QSGD(s)
    out = scheme.decode(scheme.encode(x, gen()), 500, gen())
    norm = x.double().norm()
    scaled = x.double().abs() * s / norm
    level = out.double().abs() * s / norm
    assert torch.all((level - scaled.floor()).round().abs() <= 1)
    assert torch.all((out == 0) | (out.sign() == x.sign()))


@pytest.mark.parametrize(
    ("scheme", "draws", "tol"),
    [(QSGD(2), 4000, 0.05), (RandK(0.1, unbiased=True), 4000, 0.3)],
    ids=["qsgd", "randk"],
)
def test_random_schemes_are_unbiased(scheme, draws: int, tol: float) -> None:
    """The mean of many independent decodes approaches x: the largest deviation over 200
    entries, in units of the standard error, stays within the bound of a normal maximum.
    (A biased variant fails: top-k's mean misses every small entry; random-k without the
    d/k scaling averages to x/10.)"""
    x = vector(200, seed=7)
    outs = torch.stack(
        [scheme.decode(scheme.encode(x, gen(i)), 200, gen(i)) for i in range(draws)]
    ).double()
    mean, se = outs.mean(0), outs.std(0) / math.sqrt(draws)
    random = se > 1e-9  # an entry that sits on a level is sent as it is
    z = ((mean - x.double())[random] / se[random]).abs()
    assert int(random.sum()) > 150
    assert float(z.max()) < 4.5  # P(max of 200 |N(0,1)| > 4.5) ~ 1e-3
    assert float((mean - x.double()).abs().max()) < tol * float(x.abs().max())
    # and it is not the identity: a single draw differs from x
    assert not torch.allclose(outs[0].float(), x)


def test_fp16_is_exact_on_half_representable_values_and_halves_the_bytes() -> None:
    x = vector(1000).half().float()  # every entry representable in fp16
    scheme = FP16()
    payload = scheme.encode(x, gen())
    assert payload.nbytes == 1000 * 2
    assert torch.equal(scheme.decode(payload, 1000, gen()), x)


def test_fp16_clamps_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 1.0])
    out = FP16().decode(FP16().encode(x, gen()), 3, gen())
    assert torch.isfinite(out).all() and out[0] == 65504.0


def test_int8_error_is_at_most_half_a_step() -> None:
    x = vector(1000)
    scheme = Int8()
    payload = scheme.encode(x, gen())
    assert payload.nbytes == 4 + 1000
    out = scheme.decode(payload, 1000, gen())
    step = float(x.abs().max()) / 127
    assert float((out - x).abs().max()) <= step / 2 + 1e-6
    assert float(out.abs().max()) == pytest.approx(float(x.abs().max()), rel=1e-6)
    zero = torch.zeros(10)
    assert torch.equal(scheme.decode(scheme.encode(zero, gen()), 10, gen()), zero)
