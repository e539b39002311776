"""SecureBoost (Cheng et al., arXiv:1901.08755; docs/vertical.md) with GH packing,
cipher compression and histogram subtraction (SecureBoost+, arXiv:2110.10927). Its plaintext
path equals XGBoost's ``hist`` booster on the same cuts to float32 rounding (module ``tree``).

Per tree (depthwise, as XGBoost's default grow policy):
  1. guest: g, h at the current margins; [[g]], [[h]] (or packed [[gh]]) -> every host;
  2. per level, guest -> host: each node's instance ids; host -> guest: per node, bucket sums
     over opaque feature ids (siblings by subtraction);
  3. guest: decrypts, scans every party's candidates (global column order: guest, then host 1,
     ...), keeps the best; a host split: guest -> host the winning (opaque feature, bucket)s,
     host -> guest a record id and the ids going left; the guest stores (party, record id);
  4. leaves: eta × (−G/(H + λ)), held by the guest.
Prediction walks each tree at the guest; hosts answer one direction bit per (record, row).

``multi:softprob`` grows ``num_class`` trees per boosting round, as XGBoost does: the softmax
g, h of every class at the round's starting margins, then one tree per class, each with its own
encrypted (packed) gradients. Missing values (NaN, in any party's block) follow XGBoost's
sparsity-aware split finding (module ``tree``); a host keeps its splits' default direction in
its lookup table and applies it itself, in training and at prediction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fedloom.vertical.binning import goes_left
from fedloom.vertical.data import check_parts
from fedloom.vertical.messages import PREDICT, Channel, host_name
from fedloom.vertical.secureboost_roles import (
    GradientEncoding,
    Guest,
    Host,
    NodeRequest,
)
from fedloom.vertical.tree import Node, Objective, Tree, TreeParams, leaf_value, split_allowed

GUEST = "guest"


class SecureBoost:
    """Vertical gradient-boosted trees; XGBoost's parameter names. ``fit([X_guest, X_host,
    ...], y)`` returns the model; ``encrypt=True`` runs the Paillier protocol (``packing``:
    SecureBoost+'s GH packing and cipher compression; histogram subtraction always).
    ``n_trees`` counts boosting rounds: ``multi:softprob`` grows ``num_class`` trees in each."""

    def __init__(
        self,
        n_trees: int = 10,
        max_depth: int = 3,
        eta: float = 0.3,
        max_bin: int = 32,
        reg_lambda: float = 1.0,
        gamma: float = 0.0,
        min_child_weight: float = 1.0,
        base_score: float | Sequence[float] | None = None,
        *,
        objective: str = "binary:logistic",
        num_class: int | None = None,
        encrypt: bool = False,
        key_bits: int = 2048,
        packing: bool = True,
        seed: int = 0,
        keep_messages: bool = False,
    ) -> None:
        self.n_trees, self.max_bin, self.base_score = n_trees, max_bin, base_score
        self.params = TreeParams(max_depth, eta, reg_lambda, gamma, min_child_weight)
        self.objective = Objective(objective, num_class)
        self.encrypt, self.key_bits, self.packing = encrypt, key_bits, packing
        self.seed, self.keep_messages = seed, keep_messages
        self.trees_: list[Tree] = []

    @property
    def n_outputs(self) -> int:
        """Margins per row and trees per boosting round (num_class, or 1)."""
        return self.objective.n_outputs

    def fit(
        self,
        parts: Sequence[np.ndarray],
        y: np.ndarray,
        callback: Callable[[int, Any], None] | None = None,
        resume: dict[str, Any] | None = None,
    ) -> SecureBoost:
        """Train ``n_trees`` boosting rounds on the parties' blocks (guest first; NaN: a
        missing value) and the guest's labels; ``resume``: a :meth:`state_dict` to continue
        from (the same data and settings). ``callback(round, model)`` after each round."""
        blocks = check_parts(parts, len(y), allow_missing=True)
        y = np.asarray(y, dtype=np.float64)
        self.objective.check_labels(y)
        self.channel_ = channel = Channel(keep_messages=self.keep_messages)
        keypair = None
        if self.encrypt:
            from fedloom.secure.paillier import generate_keypair

            with channel.crypto():
                keypair = generate_keypair(self.key_bits)
        kind = "plain" if keypair is None else ("packed" if self.packing else "separate")
        self.guest_ = Guest(
            GUEST, channel, blocks[0], y, self.max_bin, self.params, GradientEncoding(kind, keypair)
        )
        self.hosts_ = [
            Host(host_name(i), channel, b, self.max_bin, i, self.seed)
            for i, b in enumerate(blocks[1:], start=1)
        ]
        if keypair is not None:
            for host in self.hosts_:
                self.guest_.send(host, "public_key", keypair.public_key.n, stage="setup")
        base = self.base_score
        if base is None:
            base = self.objective.default_base_score(y)
        self.base_score_ = (
            float(base) if isinstance(base, float | int) else [float(b) for b in base]
        )
        self.base_margin_ = self.objective.base_margin(self.base_score_)
        margin = np.tile(self.base_margin_, (len(y), 1))
        self.train_margin_ = margin if self.objective.is_multiclass else margin[:, 0].copy()
        self.trees_ = []
        if resume is not None:
            self._load_state_dict(resume)
        k = self.n_outputs
        for r in range(len(self.trees_) // k, self.n_trees):
            channel.round = r
            margins = self._margins(self.train_margin_)
            g, h = self.objective.grad_hess(self.train_margin_, self.guest_.y)
            g2, h2 = g.reshape(len(y), k), h.reshape(len(y), k)
            for c in range(k):
                tree = self._grow(len(self.trees_), g2[:, c], h2[:, c], margins[:, c])
                self.trees_.append(tree)
            if callback is not None:
                callback(r, self)
        return self

    @staticmethod
    def _margins(margin: np.ndarray) -> np.ndarray:
        """An (n, outputs) view of the margins (a binary or regression model keeps (n,))."""
        return margin if margin.ndim == 2 else margin[:, None]

    def state_dict(self) -> dict[str, Any]:
        """The state after the rounds grown so far (docs/vertical.md, Checkpoints and
        resume): the guest's trees and training margins, each host's lookup table and the
        channel's records; never a key (a resumed encrypted run generates a fresh one)."""
        return {
            "trees": [[dataclasses.asdict(n) for n in t.nodes] for t in self.trees_],
            "train_margin": self.train_margin_.copy(),
            "lookups": [[[r, *v] for r, v in h.lookup.items()] for h in self.hosts_],
            "channel": self.channel_.state_dict(),
        }

    def _load_state_dict(self, saved: dict[str, Any]) -> None:
        self.trees_ = [Tree([Node(**n) for n in nodes]) for nodes in saved["trees"]]
        self.train_margin_ = np.array(saved["train_margin"], dtype=np.float32)
        for host, lookup in zip(self.hosts_, saved["lookups"], strict=True):
            host.lookup = {
                int(r): (int(f), float(thr), bool(rest[0]) if rest else False)
                for r, f, thr, *rest in lookup
            }
        self.channel_.load_state_dict(saved["channel"])

    def _grow(self, t: int, g: np.ndarray, h: np.ndarray, margin: np.ndarray) -> Tree:
        """Tree ``t`` (over all rounds and classes) on g, h; adds its leaves to ``margin``
        (a view of the training margins of its output)."""
        guest, hosts, p = self.guest_, self.hosts_, self.params
        payload = guest.gradients_message(g, h)
        for host in hosts:
            msg = guest.send(host, "gradients", payload, stage="gradients")
            host.receive_gradients(t, msg[0])
        n = len(g)
        root = Node(0, 0, float(np.sum(g, dtype=np.float64)), float(np.sum(h, dtype=np.float64)))
        tree = Tree([root])
        frontier: list[tuple[Node, int | None, np.ndarray]] = [(root, None, np.arange(n))]
        while frontier:
            for node, _, ids in frontier:  # depth max_depth: a leaf, no histograms needed
                if node.depth >= p.max_depth:
                    node.value = float(leaf_value(p, node.grad, node.hess))
                    margin[ids] += np.float32(node.value)
            frontier = [f for f in frontier if f[0].depth < p.max_depth]
            if not frontier:
                break
            requests = [NodeRequest(node.node_id, parent, ids) for node, parent, ids in frontier]
            replies = []
            for host in hosts:
                msg = guest.send(host, "node_instances", requests, stage="histograms")
                hists = host.histograms(msg[0])
                replies.append(host.send(guest, "histograms", hists, stage="histograms")[0])
            nxt: list[tuple[Node, int | None, np.ndarray]] = []
            for i, (node, _, ids) in enumerate(frontier):
                best = guest.own_candidate(ids, node.grad, node.hess)
                best_party, tied = 0, []
                for k in range(1, len(hosts) + 1):
                    found = guest.host_candidates(replies[k - 1][i], node.grad, node.hess)
                    top, ties = found.best()
                    if ties and (best is None or top > best.loss_chg):
                        best, best_party, tied = found.candidate(ties[0][0]), k, ties
                        host_found = found
                if best is None or not split_allowed(p, best.loss_chg, node.depth):
                    node.value = float(leaf_value(p, node.grad, node.hess))
                    margin[ids] += np.float32(node.value)
                    continue
                node.party = best_party
                if best_party == 0:
                    node.feature = best.feature
                    node.default_left = best.default_left
                    node.threshold = self.guest_.cuts.threshold(
                        best.feature, best.bin, best.default_left
                    )
                    left = guest.left_ids(ids, node.feature, node.threshold, node.default_left)
                else:
                    host = hosts[best_party - 1]
                    msg = guest.send(host, "split", node.node_id, tied, stage="split")
                    record = host.send(
                        guest, "split_record", host.split(msg[0], msg[1]), stage="split"
                    )[0]
                    node.record_id = record.record_id
                    best = host_found.candidate(record.opaque_feature)
                    left = record.left_ids
                right = np.setdiff1d(ids, left, assume_unique=True)
                lnode = Node(len(tree.nodes), node.depth + 1, best.grad_left, best.hess_left)
                tree.nodes.append(lnode)
                rnode = Node(
                    len(tree.nodes),
                    node.depth + 1,
                    node.grad - best.grad_left,
                    node.hess - best.hess_left,
                )
                tree.nodes.append(rnode)
                node.left, node.right = lnode.node_id, rnode.node_id
                nxt += [(lnode, node.node_id, left), (rnode, node.node_id, right)]
            frontier = nxt
        return tree

    # -- prediction -------------------------------------------------------------------------
    def predict_margin(self, parts: Sequence[np.ndarray], n_trees: int | None = None) -> np.ndarray:
        """float32 margins of new rows (parties' blocks, guest first; NaN: missing), (n,) or
        (n, num_class), by cross-party traversal: each host sends one direction bit per (its
        record, row). ``n_trees``: the first that many boosting rounds."""
        blocks = check_parts(parts, allow_missing=True)
        if len(blocks) != 1 + len(self.hosts_):
            raise ValueError(f"expected {1 + len(self.hosts_)} parties' blocks, got {len(blocks)}")
        k = self.n_outputs
        trees = self.trees_[: k * n_trees if n_trees is not None else len(self.trees_)]
        bits: dict[tuple[int, int], np.ndarray] = {}
        for party, host in enumerate(self.hosts_, start=1):
            wanted = sorted(
                {n.record_id for t in trees for n in t.nodes if n.party == party and not n.is_leaf}
            )
            if not wanted:
                continue
            msg = self.guest_.send(host, "predict_request", np.array(wanted), stage=PREDICT)
            answer = host.directions(blocks[party], [int(r) for r in msg[0]])
            reply = host.send(self.guest_, "directions", np.packbits(answer, axis=1), stage=PREDICT)
            unpacked = np.unpackbits(reply[0], axis=1, count=answer.shape[1]).astype(bool)
            for r, row in zip(wanted, unpacked, strict=True):
                bits[(party, int(r))] = row
        x_guest = blocks[0]
        n_rows = x_guest.shape[0]
        margin = np.tile(self.base_margin_, (n_rows, 1))
        rows = np.arange(n_rows)
        for t, tree in enumerate(trees):
            where = np.zeros(n_rows, dtype=np.int64)
            for node in tree.nodes:  # children come after their parent: one pass
                at = where == node.node_id
                if node.is_leaf or not at.any():
                    continue
                if node.party == 0:
                    go_left = goes_left(
                        x_guest[:, node.feature], node.threshold, bool(node.default_left)
                    )  # type: ignore[arg-type]
                else:
                    go_left = bits[(node.party, node.record_id)]  # type: ignore[index]
                where[at] = np.where(go_left[at], node.left, node.right)  # type: ignore[arg-type]
            values = np.array([n.value if n.is_leaf else 0.0 for n in tree.nodes], np.float32)
            margin[:, t % k] = margin[:, t % k] + values[where[rows]]
        return margin if self.objective.is_multiclass else margin[:, 0]

    def predict_proba(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        return self.objective.transform(self.predict_margin(parts))

    def predict(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        out = self.predict_proba(parts)
        if self.objective.is_multiclass:
            return np.argmax(out, axis=1)
        return (out > 0.5).astype(np.int64) if self.objective.is_binary else out

    @property
    def transcript_(self):
        return self.channel_.transcript

    def guest_model(self) -> dict[str, Any]:
        """The guest's model as plain data: base margin and trees (host splits only as
        (party, record id))."""
        return {
            "base_score": self.base_score_,
            "objective": self.objective.name,
            "num_class": self.objective.num_class,
            "trees": [t.to_dict() for t in self.trees_],
        }
