"""SecureBoost (Cheng et al., arXiv:1901.08755): the plaintext path against xgboost.train on the
same cuts, the encrypted path against the plaintext one, lookup tables, cross-party prediction,
GH packing, and who sees what."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xgboost as xgb

from fedloom.secure.paillier import generate_keypair
from fedloom.vertical import SecureBoost
from fedloom.vertical.binning import QuantileCuts
from fedloom.vertical.histograms import (
    EncryptedGradients,
    HistogramKernel,
    HistogramPayload,
    decode_histogram,
    encode_gradients,
)
from fedloom.vertical.secureboost_roles import NodeRequest, SplitRecord
from tests.vertical.conftest import KEY_BITS

GUEST_COLS = 10  # guest = breast_cancer cols 0-9 + label, host = cols 10-29 (FATE's breast_hetero)


def _parts(x: np.ndarray) -> list[np.ndarray]:
    return [x[:, :GUEST_COLS], x[:, GUEST_COLS:]]


def _xgboost(
    x, y, *, max_bin, max_depth, n_trees, gamma, base_score, objective="binary:logistic", **extra
):
    """xgboost.train with fedloom's defaults (``extra``: e.g. num_class)."""
    params = {
        "tree_method": "hist", "objective": objective, "max_bin": max_bin,
        "max_depth": max_depth, "eta": 0.3, "lambda": 1.0, "alpha": 0.0, "gamma": gamma,
        "min_child_weight": 1.0, "base_score": base_score, "nthread": 1, **extra,
    }  # fmt: skip
    return xgb.train(params, xgb.DMatrix(x, label=y), n_trees)


@pytest.mark.parametrize(
    ("max_bin", "max_depth", "n_trees", "gamma"),
    [(32, 3, 10, 0.0), (256, 6, 20, 0.0), (32, 3, 10, 0.5)],
)
def test_secureboost_plain_equals_xgboost(breast_cancer_split, max_bin, max_depth, n_trees, gamma):
    """Margins on train and test equal bst.predict(output_margin=True) to float32 ulps, and
    every tree has xgboost's leaf count."""
    x_tr, x_te, y_tr, _ = breast_cancer_split
    base = float(np.mean(y_tr))
    kw = {"max_bin": max_bin, "max_depth": max_depth, "n_trees": n_trees, "gamma": gamma}
    model = SecureBoost(**kw, base_score=base).fit(_parts(x_tr), y_tr)
    bst = _xgboost(x_tr, y_tr, **kw, base_score=base)
    for x in (x_tr, x_te):
        expected = bst.predict(xgb.DMatrix(x), output_margin=True)
        np.testing.assert_allclose(model.predict_margin(_parts(x)), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(model.train_margin_, bst.predict(xgb.DMatrix(x_tr),
                               output_margin=True), rtol=1e-6, atol=1e-6)  # fmt: skip
    assert [t.n_leaves for t in model.trees_] == [d.count("leaf=") for d in bst.get_dump()]


def test_secureboost_regression_three_parties_equals_xgboost(diabetes_standardised):
    """reg:squarederror with two hosts: the same equality (column order = party order)."""
    x, y = diabetes_standardised
    parts = [x[:, :4], x[:, 4:7], x[:, 7:]]
    model = SecureBoost(10, 4, max_bin=32, base_score=0.0, objective="reg:squarederror")
    model.fit(parts, y)
    bst = _xgboost(x, y, max_bin=32, max_depth=4, n_trees=10, gamma=0.0, base_score=0.0,
                   objective="reg:squarederror")  # fmt: skip
    expected = bst.predict(xgb.DMatrix(x), output_margin=True)
    np.testing.assert_allclose(model.predict_margin(parts), expected, rtol=1e-6, atol=1e-6)


def test_cuts_are_per_column(breast_cancer_split):
    """A host's own sketch equals the full matrix's cuts of its columns (docs/vertical.md,
    SecureBoost, "Exactness")."""
    x_tr = breast_cancer_split[0]
    full = QuantileCuts.sketch(x_tr, 32)
    host = QuantileCuts.sketch(x_tr[:, GUEST_COLS:], 32)
    for k in range(host.n_features):
        np.testing.assert_array_equal(host.feature_cuts(k), full.feature_cuts(GUEST_COLS + k))
    assert full.feature_cuts(0)[0] < x_tr[:, 0].min()  # the first cut lies below every value


# -- encrypted path: one 2-tree run, shared --------------------------------------------------
SMALL = {"n_trees": 2, "max_depth": 3, "max_bin": 16}


@pytest.fixture(scope="module")
def boosted(breast_cancer_split):
    x_tr, _, y_tr, _ = breast_cancer_split
    base = float(np.mean(y_tr))
    plain = SecureBoost(**SMALL, base_score=base, keep_messages=True).fit(_parts(x_tr), y_tr)
    enc = SecureBoost(**SMALL, base_score=base, encrypt=True, key_bits=KEY_BITS,
                      keep_messages=True).fit(_parts(x_tr), y_tr)  # fmt: skip
    return plain, enc


def _structure(model: SecureBoost) -> list[tuple]:
    """(party, feature, threshold) per split node and the value per leaf, tree by tree."""
    out = []
    for tree in model.trees_:
        for n in tree.nodes:
            if n.is_leaf:
                out.append(("leaf", n.value))
            elif n.party == 0:
                out.append((0, n.feature, n.threshold, n.default_left))
            else:
                out.append((n.party, *model.hosts_[n.party - 1].lookup[n.record_id]))
    return out


def test_secureboost_encrypted_equals_plain(boosted, breast_cancer_split):
    """1024-bit keys, 2 trees, depth 3, max_bin 16 (GH packing, compression, subtraction):
    identical structure and margins within 1e-9 of the plaintext path."""
    plain, enc = boosted
    assert _structure(enc) == _structure(plain)
    assert any(s[0] == 1 for s in _structure(plain))  # the host does win splits
    np.testing.assert_allclose(enc.train_margin_, plain.train_margin_, atol=1e-9, rtol=0)
    x_te = breast_cancer_split[1]
    np.testing.assert_allclose(enc.predict_margin(_parts(x_te)),
                               plain.predict_margin(_parts(x_te)), atol=1e-9, rtol=0)  # fmt: skip


def test_secureboost_lookup_privacy(boosted):
    """The guest's model holds (party, record id) for host splits, never a host feature or
    threshold; the hosts hold the thresholds; the serialised guest model has no host value."""
    _, enc = boosted
    host = enc.hosts_[0]
    guest_json = json.dumps(enc.guest_model())
    host_nodes = [n for t in enc.trees_ for n in t.nodes if not n.is_leaf and n.party == 1]
    assert host_nodes
    for n in host_nodes:
        assert n.feature is None and n.threshold is None and n.record_id in host.lookup
    thresholds = {repr(float(thr)) for _, thr, _ in host.lookup.values()}
    values = {repr(float(v)) for v in np.unique(host.x.astype(np.float32))}
    numbers = set(
        guest_json.replace("[", " ").replace("]", " ").replace(",", " ").replace("}", " ").split()
    )
    own = {repr(float(n.threshold)) for t in enc.trees_ for n in t.nodes if n.party == 0}
    assert not (thresholds | values) & (numbers - own)  # a guest cut may equal a host value
    assert all(isinstance(thr, float) for _, thr, _ in host.lookup.values())


def test_secureboost_distributed_predict(boosted, breast_cancer_split):
    """Cross-party traversal (hosts answer direction bits) equals evaluating the joined model
    in one place, and reproduces the training margins."""
    _, enc = boosted
    x_tr, x_te, _, _ = breast_cancer_split
    np.testing.assert_array_equal(enc.predict_margin(_parts(x_tr)), enc.train_margin_)
    joined = np.full(len(x_te), enc.base_margin_, dtype=np.float32)
    for tree in enc.trees_:
        for i, row in enumerate(x_te.astype(np.float32)):
            node = tree.nodes[0]
            while not node.is_leaf:
                if node.party == 0:
                    feature, thr = node.feature, node.threshold
                else:
                    k, thr, _ = enc.hosts_[0].lookup[node.record_id]
                    feature = GUEST_COLS + k
                node = tree.nodes[node.left if row[feature] < np.float32(thr) else node.right]
            joined[i] += np.float32(node.value)
    np.testing.assert_array_equal(enc.predict_margin(_parts(x_te)), joined)
    sent = enc.transcript_.select(stage="predict", sender="host:1")
    assert sent and all(d.message.payload[0].dtype == np.uint8 for d in sent)  # bits only


def assert_views(model: SecureBoost) -> None:
    """Who sees what, for any number of hosts: a host hears from the guest only, and receives
    g, h only encrypted, instance ids, the chosen (opaque feature, bucket, direction) and
    integers; the guest receives no float from a host (no feature value, no threshold): per
    node ciphertexts with integer counts and one missing-flag bit per opaque feature, the ids
    going left, direction bits."""
    transcript = model.transcript_
    hosts = [h.name for h in model.hosts_]
    for name in hosts:
        received = transcript.select(receiver=name)
        assert received and {d.sender for d in received} == {"guest"}
        for d in received:
            for item in d.message.payload:
                if isinstance(item, EncryptedGradients):
                    assert item.kind == "packed" and not any(
                        isinstance(v, np.ndarray) and v.dtype.kind == "f"
                        for v in item.channels.values()
                    )
                elif isinstance(item, list) and item and isinstance(item[0], NodeRequest):
                    assert all(r.ids.dtype.kind == "i" for r in item)
                elif isinstance(item, list):  # the tied (opaque feature, bucket, default_left)
                    assert all(isinstance(v, int | bool) for t in item for v in t), d.kind
                else:
                    assert isinstance(item, int | np.ndarray), (d.kind, type(item))
                    assert not (isinstance(item, np.ndarray) and item.dtype.kind == "f")
    for d in transcript.select(receiver="guest"):
        assert d.sender in hosts
        for item in d.message.payload:
            if isinstance(item, list):  # histograms: ciphertexts, integer counts, flag bits
                for h in item:
                    assert isinstance(h, HistogramPayload) and h.kind == "packed"
                    assert h.counts is not None and h.counts.dtype.kind == "i"
                    assert h.missing is not None and h.missing.dtype == bool
            elif isinstance(item, SplitRecord):
                assert item.left_ids.dtype.kind == "i"
            else:
                assert isinstance(item, np.ndarray) and item.dtype == np.uint8, d.kind


def test_secureboost_views(boosted):
    plain, enc = boosted
    assert_views(enc)
    # the plaintext path, by contrast, ships g and h in the clear
    first = plain.transcript_.select(kind="gradients")[0].message.payload[0]
    assert first.kind == "plain"


def test_secureboost_packing(breast_cancer_split):
    """GH-packed and compressed histograms decode to the unpacked sums (and to float64
    bincount sums) within 2^-p·count; parent − child equals the sibling."""
    x_tr, _, y_tr, _ = breast_cancer_split
    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 0.99, len(y_tr)).astype(np.float32)
    g, h = (p - y_tr).astype(np.float32), (p * (1 - p)).astype(np.float32)
    cuts = QuantileCuts.sketch(x_tr[:, :6], 16)
    bins = cuts.bin(x_tr[:, :6])
    ids = np.sort(rng.choice(len(y_tr), 150, replace=False))
    keypair = generate_keypair(KEY_BITS)
    plain = HistogramKernel(encode_gradients("plain", g, h)).build(bins, ids, cuts.max_bins)
    perm = np.arange(6)
    results = {}
    for kind, compress in (("separate", False), ("packed", False), ("packed", True)):
        grads = encode_gradients(kind, g, h, public_key=keypair.public_key)
        kernel = HistogramKernel(grads, compress=compress)
        payload = kernel.export(kernel.build(bins, ids, cuts.max_bins), perm)
        results[kind, compress] = decode_histogram(
            payload, keypair.private_key, layout=grads.layout, g_offset=1.0
        )
        if compress:
            assert payload.slots > 1 and len(payload.channels["gh"]) < 6 * cuts.max_bins
    bound = 2.0**-53 * plain.counts + 1e-15
    for key, (gs, hs) in results.items():
        assert np.all(np.abs(gs - plain.channels["g"]) <= bound), key
        assert np.all(np.abs(hs - plain.channels["h"]) <= bound), key
        np.testing.assert_allclose(gs, results["separate", False][0], atol=2.0**-50, rtol=0)
    # histogram subtraction on ciphertexts
    grads = encode_gradients("packed", g, h, public_key=keypair.public_key)
    kernel = HistogramKernel(grads, compress=True)
    parent = kernel.build(bins, np.arange(len(y_tr)), cuts.max_bins)
    child = kernel.build(bins, ids, cuts.max_bins)
    rest = np.setdiff1d(np.arange(len(y_tr)), ids)
    sibling = kernel.subtract(parent, child)
    got = decode_histogram(kernel.export(sibling, perm), keypair.private_key,
                           layout=grads.layout)  # fmt: skip
    want = HistogramKernel(encode_gradients("plain", g, h)).build(bins, rest, cuts.max_bins)
    np.testing.assert_allclose(got[0], want.channels["g"], atol=1e-12, rtol=0)
    np.testing.assert_array_equal(sibling.counts, want.counts)
    assert isinstance(grads, EncryptedGradients)


@pytest.mark.slow
def test_secureboost_unpacked_encrypted_equals_plain(boosted, breast_cancer_split):
    """The original SecureBoost encoding ([[g]], [[h]] apart, one re-randomised ciphertext per
    bucket sum): the same first tree and margins (about 8 s at 1024 bits)."""
    plain, _ = boosted
    x_tr, _, y_tr, _ = breast_cancer_split
    kw = {**SMALL, "n_trees": 1}
    enc = SecureBoost(**kw, base_score=float(np.mean(y_tr)), encrypt=True, key_bits=KEY_BITS,
                      packing=False).fit(_parts(x_tr), y_tr)  # fmt: skip
    first = len(plain.trees_[0].nodes)
    assert _structure(enc) == _structure(plain)[:first]
    np.testing.assert_allclose(enc.train_margin_, plain.predict_margin(_parts(x_tr), n_trees=1),
                               atol=1e-9, rtol=0)  # fmt: skip
