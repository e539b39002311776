"""SecAgg and SecAgg+ acceptance tests (privacy_secagg.md, section 4): n = 20 clients,
d = 10,000, b = 22, t = 11, keys from ``key_seed`` so every run is the same."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pytest
from scipy import stats

from fedloom.secure import secagg_crypto as crypto
from fedloom.secure import shamir
from fedloom.secure.base import DropStage, SecureAggregationConfigError, SecureSum
from fedloom.secure.quantize import step
from fedloom.secure.secagg import SecAgg, SecAggAbort, SecAggPlus
from fedloom.secure.secagg_client import UnmaskRefused
from fedloom.secure.secagg_messages import UnmaskRequest
from fedloom.secure.secagg_round import SecAggRound
from fedloom.secure.secagg_server import MessageRejected
from fedloom.secure.transcript import CLIENTS, SERVER, client_id

N, D, BITS, T, CLIP = 20, 10_000, 22, 11, 8.0
ROUND = 3


def _vectors(n: int, d: int = D, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {u: rng.normal(scale=4.0, size=d) for u in range(n)}


def _inputs(protocol: SecAgg | SecAggPlus, vectors: Mapping[int, np.ndarray]) -> dict:
    return {u: protocol.quantize(ROUND, u, x) for u, x in vectors.items()}


def _plain_sum(inputs: Mapping[int, np.ndarray], included: list[int]) -> np.ndarray:
    return np.sum(np.stack([inputs[u] for u in included]), axis=0, dtype=np.uint32)


def _seeded_drops(n: int, count: int, seed: int, stages: tuple[DropStage, ...]) -> dict:
    dropped = np.random.default_rng(seed).choice(n, size=count, replace=False)
    return {int(u): stages[i % len(stages)] for i, u in enumerate(sorted(dropped))}


def _secagg() -> SecAgg:
    return SecAgg(CLIP, BITS, T, key_seed=11)


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3])
def test_secagg_exact_sum(fraction: float) -> None:
    protocol = _secagg()
    inputs = _inputs(protocol, _vectors(N))
    drops = _seeded_drops(N, math.floor(fraction * N), seed=42, stages=("keys", "shares"))
    senders = {u: q for u, q in inputs.items() if u not in drops}
    result = protocol.masked_sum(ROUND, senders, drops)
    assert result.included == sorted(senders)
    assert result.total.dtype == np.uint32
    assert np.array_equal(result.total, _plain_sum(inputs, result.included))


def test_secagg_drop_after_masked_input() -> None:
    protocol = _secagg()
    inputs = _inputs(protocol, _vectors(N))
    drops = _seeded_drops(N, 3, seed=7, stages=("unmask",))
    result = protocol.masked_sum(ROUND, inputs, drops)
    assert set(drops) <= set(result.included)
    assert result.included == list(range(N))
    assert np.array_equal(result.total, _plain_sum(inputs, result.included))
    # two of the seeded drops before MaskedInput as well: s_v^sk and b_u rebuilt together
    drops |= {u: "shares" for u in (0, 1, 2) if u not in drops}
    senders = {u: q for u, q in inputs.items() if drops.get(u) != "shares"}
    result = protocol.masked_sum(ROUND, senders, drops)
    assert np.array_equal(result.total, _plain_sum(inputs, sorted(senders)))


def _masked_inputs(zero_value: int, full_value: int) -> tuple[np.ndarray, np.ndarray]:
    """y_0 with q_0 = zero_value everywhere and y_1 with q_1 = full_value, one round."""
    inputs = {u: np.full(D, 7, dtype=np.uint32) for u in range(N)}
    inputs[0] = np.full(D, zero_value, dtype=np.uint32)
    inputs[1] = np.full(D, full_value, dtype=np.uint32)
    result = _secagg().masked_sum(ROUND, inputs, {})
    ys = {
        client_id(d.sender): d.message.y
        for d in result.transcript.select(receiver=SERVER, kind="masked_input")
    }
    return ys[0], ys[1]


def test_secagg_masked_vector_uniform() -> None:
    y_zero, y_full = _masked_inputs(0, (1 << BITS) - 1)
    for byte in (y_zero >> 24, y_zero & 0xFF):
        counts = np.bincount(byte.astype(np.int64), minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-3
    assert stats.ks_2samp(y_zero, y_full).pvalue > 1e-3


@pytest.mark.parametrize("stage", ["keys", "shares", "unmask"])
def test_secagg_below_threshold_aborts(stage: DropStage) -> None:
    protocol = _secagg()
    inputs = _inputs(protocol, _vectors(N))
    drops: dict[int, DropStage] = _seeded_drops(N, 12, seed=3, stages=(stage,))  # 60%
    senders = {u: q for u, q in inputs.items() if stage == "unmask" or u not in drops}
    with pytest.raises(SecAggAbort, match=r"aborted at \w+: 8 .*threshold is 11; no output"):
        protocol.masked_sum(ROUND, senders, drops)


def test_secagg_below_threshold_aborts_t_minus_1_shares() -> None:
    """The unmasking shares of b_0 that t - 1 clients actually send do not give b_0; t do.
    With exactly t - 1 responders the server aborts instead of unmasking."""
    key_seed = 11
    inputs = {u: np.zeros(D, dtype=np.uint32) for u in range(N)}
    protocol = SecAggRound(ROUND, inputs, {}, _complete(N), T, key_seed)
    protocol.advertise_keys()
    protocol.share_keys()
    protocol.masked_input()
    requests = {u: UnmaskRequest(survivors=tuple(range(N)), dropped=()) for u in range(N)}
    responses = [protocol.clients[u].unmask(requests[u]) for u in range(1, T + 1)]
    shares = [shamir.share_from_bytes(shamir.x_of(r.sender), r.b_shares[0]) for r in responses]
    b_0 = crypto.random_seed(key_seed, ROUND, 0, "self-mask")
    assert shamir.combine(shares) == b_0
    for leave_out in range(T):
        fewer = shares[:leave_out] + shares[leave_out + 1 :]
        assert shamir.combine_int(fewer) != int.from_bytes(b_0, "big")

    drops: dict[int, DropStage] = {u: "unmask" for u in range(T - 1, N)}  # T - 1 respond
    with pytest.raises(SecAggAbort, match="Unmasking: 10 clients answered"):
        _secagg().masked_sum(ROUND, inputs, drops)


def _complete(n: int) -> dict[int, frozenset[int]]:
    return {u: frozenset(range(n)) - {u} for u in range(n)}


def test_secagg_never_both_shares() -> None:
    inputs = {u: np.zeros(D, dtype=np.uint32) for u in range(N)}
    protocol = SecAggRound(ROUND, inputs, {5: "shares"}, _complete(N), T, key_seed=1)
    protocol.advertise_keys()
    protocol.share_keys()
    protocol.masked_input()
    client = protocol.clients[0]
    with pytest.raises(UnmaskRefused, match=r"both the b_v and the s_v\^sk share of v in \[3\]"):
        client.unmask(UnmaskRequest(survivors=(0, 1, *range(3, 15)), dropped=(3,)))
    with pytest.raises(UnmaskRefused, match=r"\[0\]"):  # its own s_u^sk: it sent y_u
        client.unmask(UnmaskRequest(survivors=tuple(range(1, 15)), dropped=(0,)))
    # one request for b_4, a later one for s_4^sk: the second is refused
    client.unmask(UnmaskRequest(survivors=(0, 4, *range(6, 16)), dropped=(5,)))
    with pytest.raises(UnmaskRefused, match=r"\[4\]"):
        client.unmask(UnmaskRequest(survivors=tuple(range(6, 17)), dropped=(4,)))
    assert isinstance(UnmaskRefused("x"), SecAggAbort)
    # an honest run never asks any client for both shares of one v
    result = SecAgg(CLIP, BITS, T, key_seed=1).masked_sum(ROUND, inputs, {5: "shares", 6: "keys"})
    b_asked, sk_asked = set(), set()
    for d in result.transcript.select(receiver=SERVER, kind="unmask_response"):
        b_asked |= set(d.message.b_shares)
        sk_asked |= set(d.message.sk_shares)
    assert sk_asked == {5}
    assert b_asked == set(result.included)
    assert not b_asked & sk_asked


def test_secagg_late_masked_input_rejected() -> None:
    """y_u from a client the server declared dropped (its s_u^sk is about to be rebuilt)
    is rejected, and the sum is that of U3 alone."""
    inputs = {u: np.full(D, u, dtype=np.uint32) for u in range(N)}
    protocol = SecAggRound(ROUND, inputs, {4: "shares"}, _complete(N), T, key_seed=2)
    protocol.advertise_keys()
    protocol.share_keys()
    protocol.masked_input()
    late = protocol.clients[4].masked_input(protocol.forwarded[4], inputs[4])
    with pytest.raises(MessageRejected, match="arrived during Unmasking"):
        protocol.server.receive_masked_input(late)
    total = protocol.unmasking()
    assert np.array_equal(total, _plain_sum(inputs, [u for u in range(N) if u != 4]))


def test_secagg_server_never_receives_an_unmasked_input() -> None:
    protocol = _secagg()
    inputs = _inputs(protocol, _vectors(N))
    drops: dict[int, DropStage] = {2: "keys", 9: "shares", 13: "unmask"}
    senders = {u: q for u, q in inputs.items() if drops.get(u) not in ("keys", "shares")}
    result = protocol.masked_sum(ROUND, senders, drops)
    received = result.transcript.select(receiver=SERVER)
    assert {d.kind for d in received} == {
        "advertise_keys",
        "share_keys",
        "masked_input",
        "unmask_response",
    }
    assert received == result.transcript.select(sender=CLIENTS, receiver=SERVER)
    assert {d.round for d in result.transcript.deliveries} == {ROUND}
    ys = [d.message.y for d in received if d.kind == "masked_input"]
    assert len(ys) == len(senders)
    for y in ys:
        for q in inputs.values():
            assert not np.array_equal(y, q)
            corr = np.corrcoef(y.astype(np.float64), q.astype(np.float64))[0, 1]
            assert abs(corr) < 0.05  # 5 standard errors at d = 10,000
    # no payload the server receives contains a client's input bytes
    needles = [q[:8].tobytes() for q in inputs.values()]
    for d in received:
        if d.kind == "share_keys":
            blob = b"".join(d.message.ciphertexts.values())
            assert not any(needle in blob for needle in needles)
    # bytes: every y_u is 4 bytes per coordinate plus its sender id
    assert result.transcript.bytes_up() >= len(senders) * (4 * D + 4)
    stage_bytes = result.transcript.bytes_by_stage()
    assert stage_bytes["masked_input"][0] == len(senders) * (4 * D + 4)


def test_secaggplus_exact_sum() -> None:
    n, k, t = 50, 16, 9
    protocol = SecAggPlus(CLIP, BITS, k, t, key_seed=5, seed=1)
    inputs = _inputs(protocol, _vectors(n))
    drops = _seeded_drops(n, 15, seed=3, stages=("keys", "shares", "unmask"))  # 30%
    # 30% dropout leaves a given neighbourhood below t with probability about 2%; this seed's
    # does not (the test below forces one that does)
    graph = protocol.graph(ROUND, list(range(n)))
    assert min(len((graph[v] | {v}) - set(drops)) for v in range(n)) >= t
    senders = {u: q for u, q in inputs.items() if drops.get(u) not in ("keys", "shares")}
    result = protocol.masked_sum(ROUND, senders, drops)
    assert result.included == sorted(senders)
    assert np.array_equal(result.total, _plain_sum(inputs, result.included))
    # only neighbours exchange shares: k encrypted share pairs per client at most
    for d in result.transcript.select(receiver=SERVER, kind="share_keys"):
        assert len(d.message.ciphertexts) <= k


def test_secaggplus_exact_sum_neighbourhood_below_t_aborts() -> None:
    """Client 0 keeps k + 1 = 17 share holders; with 8 of its neighbours gone before
    unmasking, 9 = t remain and the sum is exact; with 9 gone, 8 < t remain: abort."""
    n, k, t = 50, 16, 9
    protocol = SecAggPlus(CLIP, BITS, k, t, key_seed=5, seed=1)
    inputs = _inputs(protocol, _vectors(n))
    neighbours = sorted(protocol.graph(ROUND, list(range(n)))[0])
    assert len(neighbours) == k
    drops: dict[int, DropStage] = {v: "unmask" for v in neighbours[: k - t + 1]}
    result = protocol.masked_sum(ROUND, inputs, drops)
    assert np.array_equal(result.total, _plain_sum(inputs, list(range(n))))
    drops = {v: "unmask" for v in neighbours[: k - t + 2]}
    with pytest.raises(SecAggAbort, match=r"Unmasking: 8 holders .* of 0, threshold is 9"):
        protocol.masked_sum(ROUND, inputs, drops)


def test_harary_graph_is_k_regular_and_seeded() -> None:
    protocol = SecAggPlus(CLIP, BITS, 16, 9, seed=1)
    clients = list(range(50))
    graph = protocol.graph(ROUND, clients)
    assert all(len(graph[u]) == 16 and u not in graph[u] for u in clients)
    assert all(u in graph[v] for u in clients for v in graph[u])
    assert graph == protocol.graph(ROUND, clients)
    assert graph != protocol.graph(ROUND + 1, clients)
    assert protocol.graph(ROUND, list(range(10)))[0] == frozenset(range(1, 10))  # k >= n - 1
    assert SecAggPlus().round_neighbours(100) == 20
    assert SecAggPlus().round_threshold(SecAggPlus().graph(0, list(range(100)))) == 11


def test_secagg_fedavg_equivalence() -> None:
    """Clients send [w, w x] (w = n_k / max n_k); the dequantised SecAgg FedAvg equals the
    plaintext FedAvg within n c / (2^b - 1) per coordinate."""
    vectors = _vectors(N, seed=9)
    sizes = np.random.default_rng(9).integers(10, 100, size=N)
    weights = sizes / sizes.max()
    clipped = {u: np.clip(x, -1.0, 1.0) for u, x in vectors.items()}
    payloads = {u: np.concatenate([[weights[u]], weights[u] * clipped[u]]) for u in clipped}
    drops: dict[int, DropStage] = {3: "shares", 8: "unmask"}
    result = SecAgg(CLIP, BITS, T, key_seed=3).sum(ROUND, payloads, drops)
    secure_avg = result.total[1:] / result.total[0]
    included = result.included
    plain_avg = sum(weights[u] * clipped[u] for u in included) / weights[included].sum()
    assert np.max(np.abs(secure_avg - plain_avg)) <= N * CLIP / ((1 << BITS) - 1)


def test_secure_sum_contract() -> None:
    protocol: SecureSum = SecAggPlus(CLIP, BITS, 8, 5, seed=4)  # fresh X25519 keys
    vectors = {u: x.reshape(100, 100) for u, x in _vectors(N).items()}
    drops: dict[int, DropStage] = {1: "keys", 2: "shares", 3: "unmask"}
    result = protocol.sum(ROUND, vectors, drops)
    assert result.included == [u for u in range(N) if u not in (1, 2)]
    assert result.total.dtype == np.float64 and result.total.shape == (100, 100)
    plain = sum(np.clip(vectors[u], -CLIP, CLIP) for u in result.included)
    assert np.max(np.abs(result.total - plain)) <= N * step(CLIP, BITS)
    assert result.bytes_up > len(result.included) * 4 * D
    assert result.bytes_down > 0
    assert {"crypto", "quantize", "total", "masked_input"} <= set(result.seconds)
    again = protocol.sum(ROUND, vectors, drops)  # other keys, same bits
    assert np.array_equal(again.total, result.total)
    with pytest.raises(SecAggAbort, match="threshold is 5"):
        protocol.sum(ROUND, {u: vectors[u] for u in range(3)}, {})


def test_secagg_settings_are_checked() -> None:
    with pytest.raises(SecureAggregationConfigError, match="overflows"):
        SecAgg(CLIP, 23)
    with pytest.raises(SecureAggregationConfigError, match="overflows"):
        SecAggPlus(CLIP, 22, max_clients=2000)
    with pytest.raises(SecureAggregationConfigError, match="even"):
        SecAggPlus(CLIP, BITS, 5)
    with pytest.raises(SecureAggregationConfigError, match="exceeds the 9 share holders"):
        SecAggPlus(CLIP, BITS, 8, 10)
    with pytest.raises(SecureAggregationConfigError, match="threshold"):
        SecAgg(CLIP, BITS, 0)
    small = SecAgg(CLIP, 24, max_clients=10)
    with pytest.raises(SecureAggregationConfigError, match="more than max_clients=10"):
        small.sum(0, _vectors(11, d=10), {})
