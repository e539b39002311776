"""Vertical and transfer FL: the numbers issue #16 asks for in its closing note.

    python benchmarks/vertical.py [--sections secureboost,timing,multiclass,linear,ftl] [--quick]

- ``secureboost``: the plaintext path vs ``xgboost.train`` (same cuts, base_score = mean label,
  breast_cancer's stratified 70/30 train split with random_state 0, unscaled, guest = cols
  0-9): max |margin difference| on train and test, leaf counts, for three settings (max_bin 32
  / depth 3 / 10 trees, max_bin 256 / depth 6 / 20 trees, gamma 0.5); and the encrypted
  path (1024-bit keys, 2 trees, depth 3, max_bin 16) vs the plaintext one, packed and unpacked.
- ``timing``: seconds per tree of the encrypted path (depth 3, max_bin 32, the 398 training
  rows, 20 host features), 1024 and 2048 bits, with and without GH packing + compression.
  1024 bits: mean of 2 trees; 2048 bits: 1 tree (the table says so). ``--quick`` skips 2048
  unpacked (about 2 minutes alone).
- ``multiclass``: issue #28's additions against ``xgboost.train`` (same cuts, base_score
  given): ``multi:softprob`` on wine (3 classes; guest = cols 0-4, hosts 5-8 and 9-12) and
  digits (10 classes; guest = cols 0-31, host 32-63), stratified 70/30 with random_state 0;
  missing values: breast_cancer's split with 20% of the entries NaN (``default_rng(0)``, as in
  tests/vertical/test_secureboost_missing.py), binary and on wine (multi-class); the
  encrypted path (1024 bits) vs the plaintext one for both; and seconds per encrypted tree at
  2048 bits with GH packing: wine, one round (3 trees, 124 rows, two hosts of 4 features,
  depth 3, max_bin 32) and breast_cancer with missing values (1 tree, 398 rows, 20 host
  features, depth 3, max_bin 32).
- ``linear``: secure linear (diabetes) and logistic (breast_cancer) regression, data as in
  tests/vertical/conftest.py: encrypted (1024 bits, 5 iterations, three- and two-party) vs the
  plaintext path vs centralised gradient descent (max |Θ| difference), seconds per iteration;
  then the plaintext path trained to convergence next to scikit-learn (accuracy; RMSE).
- ``ftl``: the worked example of docs/vertical.md (500 full-batch steps): B-only test accuracy
  in the clear (torch seed 0 init, and fedloom's seeded stream; scaler on all rows, as in the
  example, and on the training rows), the AHE protocol (1024 bits) and the secret-sharing
  protocol vs the plaintext path after 3 iterations (max |W| difference), seconds per
  iteration, and the secret-sharing run's accuracy after 500 steps.

Single process, single core (phe is single-threaded). Prints markdown tables, then one JSON
object as the last line.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch
import xgboost as xgb
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits, load_wine
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from fedloom.vertical import FederatedTransfer, SecureBoost, VerticalLinear, VerticalLogistic
from fedloom.vertical.data import transfer_split
from fedloom.vertical.ftl_model import (
    Alignment,
    FTLParams,
    phi_source,
    represent,
    taylor_objective,
)

G = 10  # guest = cols 0-9 (+ label), host = cols 10-29


def breast_split() -> tuple[np.ndarray, ...]:
    x, y = load_breast_cancer(return_X_y=True)
    return tuple(train_test_split(x, y, test_size=0.3, random_state=0, stratify=y))


def table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(_fmt(v) for v in r) + " |")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4f}"
    return str(v)


def secureboost_exactness() -> dict[str, Any]:
    x_tr, x_te, y_tr, _ = breast_split()
    base = float(np.mean(y_tr))
    out: dict[str, Any] = {"xgboost": [], "encrypted": []}
    rows = []
    for max_bin, depth, trees, gamma in ((32, 3, 10, 0.0), (256, 6, 20, 0.0), (32, 3, 10, 0.5)):
        model = SecureBoost(trees, depth, 0.3, max_bin, gamma=gamma, base_score=base)
        model.fit([x_tr[:, :G], x_tr[:, G:]], y_tr)
        params = {
            "tree_method": "hist", "objective": "binary:logistic", "max_bin": max_bin,
            "max_depth": depth, "eta": 0.3, "lambda": 1.0, "alpha": 0.0, "gamma": gamma,
            "min_child_weight": 1.0, "base_score": base, "nthread": 1,
        }  # fmt: skip
        bst = xgb.train(params, xgb.DMatrix(x_tr, label=y_tr), trees)
        diffs = [
            float(
                np.max(
                    np.abs(
                        model.predict_margin([x[:, :G], x[:, G:]])
                        - bst.predict(xgb.DMatrix(x), output_margin=True)
                    )
                )
            )
            for x in (x_tr, x_te)
        ]
        leaves = [t.n_leaves for t in model.trees_] == [d.count("leaf=") for d in bst.get_dump()]
        setting = f"max_bin {max_bin}, depth {depth}, {trees} trees, gamma {gamma}"
        rows.append([setting, diffs[0], diffs[1], "yes" if leaves else "NO"])
        out["xgboost"].append({"setting": setting, "train": diffs[0], "test": diffs[1],
                               "leaf_counts_equal": leaves})  # fmt: skip
    table(
        "SecureBoost plaintext path vs xgboost.train (same cuts, base_score given)",
        ["setting", "max |margin diff| train", "max |margin diff| test", "leaf counts equal"],
        rows,
    )
    rows = []
    kw = {"n_trees": 2, "max_depth": 3, "max_bin": 16, "base_score": base}
    plain = SecureBoost(**kw).fit([x_tr[:, :G], x_tr[:, G:]], y_tr)
    for packing in (True, False):
        start = time.perf_counter()
        enc = SecureBoost(**kw, encrypt=True, key_bits=1024, packing=packing)
        enc.fit([x_tr[:, :G], x_tr[:, G:]], y_tr)
        seconds = time.perf_counter() - start
        same = structure(enc) == structure(plain)
        diff = float(
            np.max(
                np.abs(
                    enc.predict_margin([x_te[:, :G], x_te[:, G:]])
                    - plain.predict_margin([x_te[:, :G], x_te[:, G:]])
                )
            )
        )
        name = "packed + compressed" if packing else "unpacked"
        rows.append([name, "yes" if same else "NO", diff, seconds])
        out["encrypted"].append({"mode": name, "identical_trees": same, "max_margin_diff": diff,
                                 "seconds": seconds})  # fmt: skip
    table(
        "SecureBoost encrypted (1024 bits, 2 trees, depth 3, max_bin 16) vs plaintext path",
        ["mode", "identical trees", "max |margin diff| test", "seconds (2 trees)"],
        rows,
    )
    return out


def structure(model: SecureBoost) -> list[tuple]:
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


WINE_COLUMNS = ((0, 5), (5, 9), (9, 13))


def _blocks(x: np.ndarray, columns) -> list[np.ndarray]:
    return [x[:, a:b] for a, b in columns]


def _blank(x: np.ndarray, rng: np.random.Generator, fraction: float = 0.2) -> np.ndarray:
    return np.where(rng.random(x.shape) < fraction, np.nan, x)


def multiclass_and_missing() -> dict[str, Any]:
    """Multi-class and missing values vs xgboost.train; encrypted vs plaintext; 2048-bit
    seconds per tree (module docstring, ``multiclass``)."""
    rng = np.random.default_rng(0)
    x_tr, x_te, y_tr, y_te = breast_split()
    breast_missing = (_blank(x_tr, rng), _blank(x_te, rng), y_tr, y_te, ((0, G), (G, 30)))
    wine = (*train_test_split(*load_wine(return_X_y=True), test_size=0.3, random_state=0,
                              stratify=load_wine(return_X_y=True)[1]), WINE_COLUMNS)  # fmt: skip
    digits_xy = load_digits(return_X_y=True)
    digits = (*train_test_split(*digits_xy, test_size=0.3, random_state=0,
                                stratify=digits_xy[1]), ((0, 32), (32, 64)))  # fmt: skip
    rng = np.random.default_rng(1)
    wine_missing = (_blank(wine[0], rng), _blank(wine[1], rng), *wine[2:])
    cases = [("wine, 3 classes", wine, 0.5, 3), ("digits, 10 classes", digits, 0.5, 10),
             ("breast_cancer, 20% missing", breast_missing, None, None),
             ("wine, 3 classes, 20% missing", wine_missing, 0.5, 3)]  # fmt: skip
    rows, out = [], {"xgboost": [], "encrypted": [], "timing": []}
    for name, (a, b, ya, _, cols), base, k in cases:
        for max_bin, depth, trees in ((32, 3, 10), (256, 6, 20)):
            kw = {"objective": "multi:softprob", "num_class": k} if k else {}
            score = base if base is not None else float(np.mean(ya))
            model = SecureBoost(trees, depth, 0.3, max_bin, base_score=score, **kw)
            model.fit(_blocks(a, cols), ya)
            params = {
                "tree_method": "hist", "objective": kw.get("objective", "binary:logistic"),
                "max_bin": max_bin, "max_depth": depth, "eta": 0.3, "lambda": 1.0,
                "alpha": 0.0, "min_child_weight": 1.0, "base_score": score, "nthread": 1,
            }  # fmt: skip
            if k:
                params["num_class"] = k
            bst = xgb.train(params, xgb.DMatrix(a, label=ya), trees)
            diffs = [
                float(np.max(np.abs(model.predict_margin(_blocks(x, cols))
                                    - bst.predict(xgb.DMatrix(x), output_margin=True))))
                for x in (a, b)
            ]  # fmt: skip
            leaves = [t.n_leaves for t in model.trees_] == [
                d.count("leaf=") for d in bst.get_dump()
            ]
            setting = f"{name}; max_bin {max_bin}, depth {depth}, {trees} rounds"
            rows.append([setting, diffs[0], diffs[1], "yes" if leaves else "NO"])
            out["xgboost"].append({"setting": setting, "train": diffs[0], "test": diffs[1],
                                   "leaf_counts_equal": leaves})  # fmt: skip
    table(
        "SecureBoost multi-class and missing values vs xgboost.train (same cuts)",
        ["setting", "max |margin diff| train", "max |margin diff| test", "leaf counts equal"],
        rows,
    )
    rows = []
    enc_cases = [("wine, 3 classes, 1 round", wine, {"objective": "multi:softprob",
                                                     "num_class": 3, "base_score": 0.5}),
                 ("breast_cancer, 20% missing, 2 trees", breast_missing,
                  {"n_trees": 2, "base_score": float(np.mean(y_tr))})]  # fmt: skip
    for name, (a, b, ya, _, cols), kw in enc_cases:
        kw = {"n_trees": 1, "max_depth": 3, "max_bin": 16, **kw}
        plain = SecureBoost(**kw).fit(_blocks(a, cols), ya)
        enc = SecureBoost(**kw, encrypt=True, key_bits=1024).fit(_blocks(a, cols), ya)
        same = structure(enc) == structure(plain)
        diff = float(np.max(np.abs(enc.predict_margin(_blocks(b, cols))
                                   - plain.predict_margin(_blocks(b, cols)))))  # fmt: skip
        rows.append([name, "yes" if same else "NO", diff])
        out["encrypted"].append({"setting": name, "identical_trees": same,
                                 "max_margin_diff": diff})  # fmt: skip
    table(
        "Encrypted (1024 bits, packed, depth 3, max_bin 16) vs plaintext path",
        ["setting", "identical trees", "max |margin diff| test"],
        rows,
    )
    rows = []
    timed = [("wine, 3 classes, 1 round = 3 trees, 124 rows, hosts 4 + 4 features", wine,
              {"objective": "multi:softprob", "num_class": 3, "base_score": 0.5}, 3),
             ("breast_cancer, 20% missing, 1 tree, 398 rows, 20 host features", breast_missing,
              {"base_score": float(np.mean(y_tr))}, 1)]  # fmt: skip
    for name, (a, _, ya, _, cols), kw, trees in timed:
        model = SecureBoost(1, 3, 0.3, 32, encrypt=True, key_bits=2048, **kw)
        start = time.perf_counter()
        model.fit(_blocks(a, cols), ya)
        per_tree = (time.perf_counter() - start) / trees
        crypto = model.channel_.crypto_seconds / trees
        sent = sum(v["sent"] for v in model.channel_.bytes_by_party().values()) / trees
        rows.append([name, per_tree, crypto, sent / 1e6])
        out["timing"].append(
            {"setting": name, "seconds_per_tree": per_tree, "crypto_seconds_per_tree": crypto,
             "mb_per_tree": sent / 1e6}
        )  # fmt: skip
    table(
        "SecureBoost encrypted at 2048 bits, GH packing + compression (depth 3, max_bin 32)",
        ["setting", "s per tree", "crypto s per tree", "MB per tree"],
        rows,
    )
    return out


def secureboost_timing(quick: bool) -> list[dict[str, Any]]:
    x_tr, _, y_tr, _ = breast_split()
    base = float(np.mean(y_tr))
    rows, out = [], []
    for bits in (1024, 2048):
        for packing in (True, False):
            if quick and bits == 2048 and not packing:
                continue
            trees = 2 if bits == 1024 else 1
            model = SecureBoost(trees, 3, 0.3, 32, base_score=base, encrypt=True, key_bits=bits,
                                packing=packing)  # fmt: skip
            start = time.perf_counter()
            model.fit([x_tr[:, :G], x_tr[:, G:]], y_tr)
            per_tree = (time.perf_counter() - start) / trees
            crypto = model.channel_.crypto_seconds / trees
            sent = sum(v["sent"] for v in model.channel_.bytes_by_party().values()) / trees
            mode = "packed + compressed" if packing else "unpacked"
            rows.append([bits, mode, trees, per_tree, crypto, sent / 1e6])
            out.append({"key_bits": bits, "mode": mode, "trees_measured": trees,
                        "seconds_per_tree": per_tree, "crypto_seconds_per_tree": crypto,
                        "mb_per_tree": sent / 1e6})  # fmt: skip
    table(
        "SecureBoost encrypted: seconds per tree (depth 3, max_bin 32, 398 rows, 20 host features)",
        ["key bits", "mode", "trees measured", "s per tree", "crypto s per tree", "MB per tree"],
        rows,
    )
    return out


def _gd(design: np.ndarray, y: np.ndarray, lr: float, lam: float, iters: int, logistic: bool):
    theta = np.zeros(design.shape[1])
    for _ in range(iters):
        z = design @ theta
        d = 0.25 * z - 0.5 * y if logistic else z - y
        theta = theta - lr * (design.T @ d / len(y) + lam * theta)
    return theta


def linear_models() -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = []
    x, y = load_diabetes(return_X_y=True)
    xs, ys = StandardScaler().fit_transform(x), (y - y.mean()) / y.std()
    lin_parts = [xs[:, 5:], xs[:, :5]]
    design_lin = np.hstack([xs[:, :5], xs[:, 5:], np.ones((len(ys), 1))])
    x_tr, x_te, y_tr, y_te = breast_split()
    sc = StandardScaler().fit(x_tr)
    b_tr, b_te = sc.transform(x_tr), sc.transform(x_te)
    log_parts = [b_tr[:, 15:], b_tr[:, :15]]
    design_log = np.hstack([b_tr[:, :15], b_tr[:, 15:], np.ones((len(y_tr), 1))])
    y_pm = np.where(y_tr > 0, 1.0, -1.0)
    for name, cls, parts, target, design, lr, logistic in (
        ("linear (diabetes)", VerticalLinear, lin_parts, ys, design_lin, 0.1, False),
        ("logistic (breast_cancer)", VerticalLogistic, log_parts, y_tr, design_log, 0.5, True),
    ):
        central = _gd(design, y_pm if logistic else target, lr, 0.01, 5, logistic)
        plain = cls(lr, 0.01, 5).fit(parts, target)
        theta_plain = np.concatenate([plain.parties_[1].theta, plain.parties_[0].theta])
        for protocol in ("three_party", "two_party"):
            start = time.perf_counter()
            enc = cls(lr, 0.01, 5, protocol=protocol, encrypt=True, key_bits=1024).fit(
                parts, target
            )
            per_iter = (time.perf_counter() - start) / 5
            theta_enc = np.concatenate([enc.parties_[1].theta, enc.parties_[0].theta])
            d_plain = float(np.max(np.abs(theta_enc - theta_plain)))
            d_central = float(np.max(np.abs(theta_plain - central)))
            rows.append([name, protocol, d_plain, d_central, per_iter])
            out[f"{name}/{protocol}"] = {"enc_vs_plain": d_plain, "plain_vs_central": d_central,
                                         "seconds_per_iteration": per_iter}  # fmt: skip
    table(
        "Vertical LR/LogR: encrypted (1024 bits) vs plaintext path vs centralised GD, 5 iterations",
        ["model", "protocol", "max |Θ| enc − plain", "max |Θ| plain − central", "s/iteration enc"],
        rows,
    )
    rows = []
    model = VerticalLogistic(0.5, 0.01, 20000).fit(log_parts, y_tr)
    acc = float(np.mean(model.predict([b_te[:, 15:], b_te[:, :15]]) == y_te))
    sk = LogisticRegression(C=1 / (0.01 * len(y_tr)), max_iter=5000).fit(b_tr, y_tr)
    rows.append(["logistic, Taylor loss, 20000 it.", "accuracy", acc, sk.score(b_te, y_te)])
    out["logistic_accuracy"] = {"fedloom": acc, "sklearn": float(sk.score(b_te, y_te))}
    dx = load_diabetes()
    d_tr, d_te, t_tr, t_te = train_test_split(dx.data, dx.target, test_size=0.3, random_state=0)
    sc = StandardScaler().fit(d_tr)
    d_tr, d_te = sc.transform(d_tr), sc.transform(d_te)
    mean, std = t_tr.mean(), t_tr.std()
    lin = VerticalLinear(0.1, 0.0, 2000).fit([d_tr[:, 5:], d_tr[:, :5]], (t_tr - mean) / std)
    pred = lin.predict([d_te[:, 5:], d_te[:, :5]]) * std + mean
    rmse = float(np.sqrt(np.mean((pred - t_te) ** 2)))
    ls = LinearRegression().fit(d_tr, t_tr)
    rmse_sk = float(np.sqrt(np.mean((ls.predict(d_te) - t_te) ** 2)))
    rows.append(["linear, λ = 0, 2000 it.", "test RMSE", rmse, rmse_sk])
    out["linear_rmse"] = {"fedloom": rmse, "sklearn": rmse_sk}
    table("Trained to convergence (plaintext path) next to scikit-learn", ["model", "metric",
          "fedloom", "scikit-learn"], rows)  # fmt: skip
    return out


def ftl() -> dict[str, Any]:
    x, y = load_breast_cancer(return_X_y=True)
    out: dict[str, Any] = {}
    rows = []
    for scale_on in ("all", "train"):
        d = transfer_split(x, y, [(0, 15), (15, 30)], (0, 400), (200, 569), (200, 300), 0, scale_on)
        args = (d.x_a, d.y_a, d.x_b, (d.overlap_a, d.overlap_b), d.labelled)
        torch.manual_seed(0)
        spec_init = (
            (torch.randn(15, 8, dtype=torch.float64) * 0.1).numpy(),
            (torch.randn(15, 8, dtype=torch.float64) * 0.1).numpy(),
        )
        if scale_on == "all":  # reference: GD on the component formulas, in one place
            align = Alignment(d.overlap_a, d.overlap_b, d.labelled)
            w_a, w_b = spec_init
            for _ in range(500):
                g = taylor_objective(w_a, w_b, d.x_a, d.y_a, d.x_b, align, FTLParams())
                w_a, w_b = w_a - 0.5 * g.grad_wa, w_b - 0.5 * g.grad_wb
            phi = phi_source(represent(d.x_a, w_a), d.y_a)
            acc = float(np.mean(np.where(represent(d.x_test, w_b) @ phi > 0, 1, -1) == d.y_test))
            rows.append([f"scaler on {scale_on}", "torch seed 0", "formulas, centralised", acc, ""])
            out["central/all/torch seed 0"] = acc
        for init_name, init in (("torch seed 0", spec_init), ("fedloom stream", None)):
            start = time.perf_counter()
            m = FederatedTransfer(iterations=500).fit(*args, init=init)
            secs = time.perf_counter() - start
            acc = float(np.mean(m.predict(d.x_test) == d.y_test))
            rows.append([f"scaler on {scale_on}", init_name, "plaintext", acc, secs / 500])
            out[f"plain/{scale_on}/{init_name}"] = acc
            if init is None and scale_on == "all":
                start = time.perf_counter()
                s = FederatedTransfer(iterations=500, protocol="secret_sharing").fit(*args)
                secs = time.perf_counter() - start
                acc_ss = float(np.mean(s.predict(d.x_test) == d.y_test))
                rows.append([f"scaler on {scale_on}", init_name, "secret sharing", acc_ss,
                             secs / 500])  # fmt: skip
                out[f"ss/{scale_on}/{init_name}"] = acc_ss
        if scale_on == "all":
            example = args
    table(
        "FTL worked example: B-only test accuracy (169 rows) after 500 steps",
        ["data", "init", "path", "accuracy", "s/iteration"],
        rows,
    )
    rows = []
    plain = FederatedTransfer(iterations=3).fit(*example)
    for name, kw in (
        ("AHE, 1024-bit keys", {"encrypt": True, "key_bits": 1024}),
        ("secret sharing, Z_2^64, f = 20", {"protocol": "secret_sharing"}),
    ):
        start = time.perf_counter()
        m = FederatedTransfer(iterations=3, **kw).fit(*example)
        per_iter = (time.perf_counter() - start) / 3
        diff = max(
            float(np.max(np.abs(a - b))) for a, b in zip(m.weights_, plain.weights_, strict=True)
        )
        loss = float(np.max(np.abs(np.array(m.loss_history_) - plain.loss_history_)))
        mb = sum(v["sent"] for v in m.channel_.bytes_by_party().values()) / 3e6
        rows.append([name, diff, loss, per_iter, mb])
        out[name] = {"max_w_diff": diff, "max_loss_diff": loss, "seconds_per_iteration": per_iter,
                     "mb_per_iteration": mb}  # fmt: skip
    table(
        "FTL protocols vs the plaintext path: worked example, 3 iterations",
        ["protocol", "max |W| diff", "max |L| diff", "s/iteration", "MB/iteration"],
        rows,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="secureboost,timing,multiclass,linear,ftl")
    parser.add_argument("--quick", action="store_true", help="skip 2048-bit unpacked timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = args.sections.split(",")
    results: dict[str, Any] = {}
    if "secureboost" in sections:
        results["secureboost"] = secureboost_exactness()
    if "timing" in sections:
        results["timing"] = secureboost_timing(args.quick)
    if "multiclass" in sections:
        results["multiclass"] = multiclass_and_missing()
    if "linear" in sections:
        results["linear"] = linear_models()
    if "ftl" in sections:
        results["ftl"] = ftl()
    print()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
