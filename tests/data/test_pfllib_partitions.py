"""PFLlib's partitions: 'pat' (pathological), Dirichlet's min-size rule, ExDir, noise skew."""

from __future__ import annotations

import numpy as np
import pytest

from fedloom.core.rng import numpy_rng
from fedloom.data import PARTITIONS, load_dataset
from fedloom.data.pfllib_partitions import pat_clients_per_class, pfllib_least_samples
from fedloom.errors import ConfigError


def _blocks(per_class: int = 100, classes: int = 10) -> np.ndarray:
    """``per_class`` samples of each class, interleaved (0, 1, ..., 0, 1, ...)."""
    return np.tile(np.arange(classes), per_class)


def _held(labels: np.ndarray, parts: list[np.ndarray]) -> list[list[int]]:
    return [sorted(np.unique(labels[p]).tolist()) for p in parts]


def _cover(parts: list[np.ndarray], n: int) -> None:
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))


# -- pathological ('pat') ----------------------------------------------------------------------


def test_pat_choice_of_clients_by_hand() -> None:
    # PFLlib: class i goes to the first ceil(N/C k) clients that still need a class.
    # N=4, C=4, k=2: cap 2; clients 0,1 take classes 0,1; clients 2,3 take classes 2,3.
    assert pat_clients_per_class(4, 4, 2) == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # N=5, C=10, k=2: cap 1; client j takes classes 2j, 2j+1.
    assert pat_clients_per_class(5, 10, 2) == [[0], [0], [1], [1], [2], [2], [3], [3], [4], [4]]
    # N=6, C=4, k=2: cap 3.
    assert pat_clients_per_class(6, 4, 2) == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    # PFLlib's floor: min(40, n / N / 2)
    assert pfllib_least_samples(70000, 20) == 40
    assert pfllib_least_samples(1000, 20) == 25


@pytest.mark.parametrize(("num_clients", "k"), [(20, 2), (10, 5), (50, 1), (4, 10), (30, 3)])
@pytest.mark.parametrize("balanced", [True, False])
def test_each_client_exactly_k_classes(num_clients: int, k: int, balanced: bool) -> None:
    labels = _blocks(120, 10) if k != 3 else _blocks(120, 9)
    part = PARTITIONS.get("pathological")(classes_per_client=k, balanced=balanced)
    parts = part(labels, num_clients, numpy_rng(0, "t"))
    _cover(parts, len(labels))
    held = _held(labels, parts)
    assert [len(h) for h in held] == [k] * num_clients
    classes = int(labels.max()) + 1
    expected = pat_clients_per_class(num_clients, classes, k)
    for c, owners in enumerate(expected):
        assert [j for j in range(num_clients) if c in held[j]] == owners


def test_balanced_shares_equal_within_one() -> None:
    # 103 samples of each of 10 classes, 20 clients x 2 classes: 4 clients per class share
    # 103 = 26 + 26 + 26 + 25 (the remaining 3 go one each to the first clients)
    labels = _blocks(103, 10)
    parts = PARTITIONS.get("pathological")(classes_per_client=2)(labels, 20, numpy_rng(1, "t"))
    for c in range(10):
        counts = sorted(int((labels[p] == c).sum()) for p in parts if (labels[p] == c).any())
        assert counts == [25, 26, 26, 26]


def test_unbalanced_sizes_follow_pfllib_bounds() -> None:
    # n=1000, N=20, k=2: 4 clients per class of 100, per = 25; least_samples = 25, so the
    # first three sizes lie in [max(2.5, 2.5), 25) = [2, 25) and the last takes the rest (> 25)
    labels = _blocks(100, 10)
    part = PARTITIONS.get("pathological")(classes_per_client=2, balanced=False)
    seen_last, seen_first = [], []
    for seed in range(5):
        parts = part(labels, 20, numpy_rng(seed, "t"))
        owners = pat_clients_per_class(20, 10, 2)
        for c, chosen in enumerate(owners):
            sizes = [int((labels[parts[j]] == c).sum()) for j in chosen]
            assert sum(sizes) == 100
            assert all(2 <= s < 25 for s in sizes[:-1])
            assert sizes[-1] > 25
            seen_first += sizes[:-1]
            seen_last.append(sizes[-1])
    assert len(set(seen_first)) > 10  # really random


def test_pat_is_seeded() -> None:
    labels = _blocks(50, 10)
    part = PARTITIONS.get("pathological")(balanced=False)
    a = part(labels, 10, numpy_rng(3, "t"))
    b = part(labels, 10, numpy_rng(3, "t"))
    c = part(labels, 10, numpy_rng(4, "t"))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize(
    ("num_clients", "k", "match"),
    [
        (7, 2, r"PFLlib.s .pat. dealing of 7 clients x 2 classes leaves class\(es\) \[8, 9\]"),
        (5, 4, r".*leaves client 4 with 2 class\(es\), not 4"),  # cap 2: client 4 gets classes 8, 9
        (
            7,
            2,
            r".*\(PFLlib drops their samples\); data.num_clients x classes_per_client a multiple",
        ),
        (5, 11, r"must be <= the number of classes \(10\)"),
    ],
)
def test_pat_refuses_what_pfllib_would_get_wrong(num_clients: int, k: int, match: str) -> None:
    part = PARTITIONS.get("pathological")(classes_per_client=k)
    with pytest.raises(ConfigError, match=r"data\.partition\.classes_per_client: " + match):
        part(_blocks(50, 10), num_clients, numpy_rng(0, "t"))


def test_pat_refuses_too_few_samples_for_random_sizes() -> None:
    part = PARTITIONS.get("pathological")(classes_per_client=2, balanced=False)
    with pytest.raises(ConfigError, match=r"data\.partition\.balanced: class 0 has 5 samples"):
        part(_blocks(5, 10), 20, numpy_rng(0, "t"))


def test_pathological_on_digits(cfg) -> None:
    fd = load_dataset(
        cfg("digits", num_clients=20, partition={"kind": "pathological"}, test_fraction=0.25),
        seed=0,
    )
    for c in fd.clients:
        assert len(np.unique(np.concatenate([c.y_train.numpy(), c.y_test.numpy()]))) == 2
    assert sum(c.num_train + c.num_test for c in fd.clients) == 1797


# -- Dirichlet with PFLlib's rule ----------------------------------------------------------------


class _FixedRng:
    """Stands in for a Generator: permutation is the identity, Dirichlet shares are given."""

    def __init__(self, shares: list[list[float]]) -> None:
        self.shares = [np.array(s) for s in shares]

    def permutation(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def dirichlet(self, alpha: np.ndarray) -> np.ndarray:
        return self.shares.pop(0)


def test_pfllib_dirichlet_rule_by_hand() -> None:
    # 3 clients, 3 classes of 6 samples: n / N = 6. Class 0 shares (.5, .5, 0) give (3, 3, 0);
    # class 1 (.5, .25, .25): cuts floor(3), floor(4.5) -> (3, 1, 2), totals (6, 4, 2); class 2
    # (.6, .2, .2): client 0 holds 6 >= n / N, so PFLlib renormalises (0, .5, .5) -> (0, 3, 3),
    # totals (6, 7, 5). Without the rule: cuts floor(3.6), floor(4.8) -> (3, 1, 2): (9, 5, 4).
    labels = np.repeat(np.arange(3), 6)
    shares = [[0.5, 0.5, 0.0], [0.5, 0.25, 0.25], [0.6, 0.2, 0.2]]
    for pfllib, sizes in ((True, [6, 7, 5]), (False, [9, 5, 4])):
        part = PARTITIONS.get("dirichlet")(alpha=1.0, min_size=1, pfllib=pfllib)
        parts = part(labels, 3, _FixedRng([list(s) for s in shares]))  # type: ignore[arg-type]
        assert [len(p) for p in parts] == sizes
    # and the samples are the class's consecutive pieces: client 2 gets class 2's last 3
    part = PARTITIONS.get("dirichlet")(alpha=1.0, min_size=1, pfllib=True)
    parts = part(labels, 3, _FixedRng([list(s) for s in shares]))  # type: ignore[arg-type]
    assert parts[2].tolist() == [10, 11, 15, 16, 17]


def _cifar100_labels() -> np.ndarray:
    return numpy_rng(0, "cifar100_labels").permutation(np.repeat(np.arange(100), 500))


@pytest.mark.parametrize("pfllib", [False, True])
def test_500_clients_on_cifar100_sized_labels_ends(pfllib: bool) -> None:
    # PFLlib's unbounded redraw loop can spin forever here; fedloom succeeds or gives up
    labels = _cifar100_labels()
    part = PARTITIONS.get("dirichlet")(alpha=0.3, min_size=40, pfllib=pfllib)
    parts = part(labels, 500, numpy_rng(1, "t"))
    _cover(parts, 50000)
    assert min(len(p) for p in parts) >= 40


def test_hopeless_dirichlet_gives_up_naming_the_numbers() -> None:
    part = PARTITIONS.get("dirichlet")(alpha=0.01, min_size=40, pfllib=True)
    with pytest.raises(ConfigError) as err:
        part(_cifar100_labels(), 500, numpy_rng(1, "t"))
    msg = str(err.value)
    for words in ("100 Dirichlet draws", "alpha=0.01", "50000 samples", "500 clients", "=40"):
        assert words in msg


# -- extended Dirichlet (ExDir) -----------------------------------------------------------------


@pytest.mark.parametrize(("k", "alpha"), [(2, 100.0), (3, 100.0), (3, 0.5), (10, 1.0)])
@pytest.mark.parametrize("balance", [True, False])
def test_exdir_clients_hold_at_most_their_classes(k: int, alpha: float, balance: bool) -> None:
    labels = _blocks(300, 10)
    part = PARTITIONS.get("extended_dirichlet")(
        classes_per_client=k, alpha=alpha, min_size=5, balance=balance
    )
    parts = part(labels, 20, numpy_rng(2, "t"))
    _cover(parts, len(labels))
    assigned = part.assign(10, 20, numpy_rng(2, "t"))  # the same stream starts with it
    for j, held in enumerate(_held(labels, parts)):
        assert set(held) <= {c for c in range(10) if assigned[c][j]}
        assert len(held) <= k
        if alpha >= 100 and not balance:  # near-equal shares: every assigned class arrives
            assert len(held) == k
    assert min(len(p) for p in parts) >= 5


def test_exdir_first_level_gives_every_class_enough_clients() -> None:
    # C N // K // 2 = 2 * 20 // 10 // 2 = 2 clients per class at least; 2 classes per client
    part = PARTITIONS.get("extended_dirichlet")(classes_per_client=2)
    for seed in range(5):
        mask = np.array(part.assign(10, 20, numpy_rng(seed, "t")))
        assert mask.sum(axis=0).tolist() == [2] * 20
        assert mask.sum(axis=1).min() >= 2


def test_exdir_alpha_controls_skew_within_class() -> None:
    labels = _blocks(300, 10)

    def spread(alpha: float) -> float:
        """Mean coefficient of variation of a class's counts over its clients."""
        part = PARTITIONS.get("extended_dirichlet")(
            classes_per_client=2, alpha=alpha, min_size=1, balance=False
        )
        parts = part(labels, 20, numpy_rng(0, "t"))
        mask = part.assign(10, 20, numpy_rng(0, "t"))
        cvs = []
        for c in range(10):
            counts = np.array([(labels[parts[j]] == c).sum() for j in np.flatnonzero(mask[c])])
            cvs.append(counts.std() / counts.mean())
        return float(np.mean(cvs))

    assert spread(1000.0) < 0.1 < 0.5 < spread(0.3)


def test_exdir_refusals() -> None:
    part = PARTITIONS.get("extended_dirichlet")(classes_per_client=1, alpha=1.0)
    with pytest.raises(ConfigError, match=r"classes_per_client: 5 clients x 1 classes cannot"):
        part(_blocks(50, 10), 5, numpy_rng(0, "t"))
    part = PARTITIONS.get("extended_dirichlet")(classes_per_client=2, alpha=0.01, min_size=40)
    with pytest.raises(ConfigError, match=r"min_size: after 100 ExDir draws \(alpha=0.01"):
        part(_blocks(100, 10), 20, numpy_rng(0, "t"))


# -- noise-based feature skew -------------------------------------------------------------------


def test_noise_level_per_client_measured(cfg) -> None:
    from fedloom.data.digits import load_digits_arrays

    sigma, n = 0.3, 4
    fd = load_dataset(
        cfg("digits", num_clients=n, partition={"kind": "noise", "sigma": sigma}), seed=5
    )
    x_raw = load_digits_arrays()[0] / 16.0
    for k in range(n):
        train_idx, test_idx = fd.extras["client_indices"][k]
        for got, idx in ((fd.clients[k].x_train, train_idx), (fd.clients[k].x_test, test_idx)):
            diff = got.numpy()[:, 0] - x_raw[idx]
            expected = sigma * k / (n - 1)  # NIID-Bench's code: 0 for client 0, sigma for the last
            assert abs(float(diff.std()) - expected) < 0.01 + 0.03 * expected
            assert abs(float(diff.mean())) < 0.01
    again = load_dataset(
        cfg("digits", num_clients=n, partition={"kind": "noise", "sigma": sigma}), seed=5
    )
    other = load_dataset(
        cfg("digits", num_clients=n, partition={"kind": "noise", "sigma": sigma}), seed=6
    )
    assert np.array_equal(again.clients[3].x_train.numpy(), fd.clients[3].x_train.numpy())
    assert not np.array_equal(other.clients[3].x_train.numpy(), fd.clients[3].x_train.numpy())


# -- PFLlib's 75/25 per-client split --------------------------------------------------------------


def test_test_fraction_quarter_matches_pfllib_but_for_rounding() -> None:
    # PFLlib: train_test_split(train_size=0.75, shuffle=True) holds out n - floor(0.75 n);
    # fedloom's data.test_fraction: 0.25 holds out round(n / 4) (half to even): one sample
    # fewer exactly when n = 1 (mod 4) or n = 2 (mod 8), n > 2 (docs/partitions.md)
    from sklearn.model_selection import train_test_split

    from fedloom.data.pool import num_test

    for n in range(2, 300):
        _, test = train_test_split(np.arange(n), train_size=0.75, shuffle=True, random_state=0)
        expected = len(test) - (1 if n % 4 == 1 or (n % 8 == 2 and n > 2) else 0)
        assert num_test(n, 0.25) == expected, n
