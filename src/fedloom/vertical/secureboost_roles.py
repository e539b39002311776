"""SecureBoost's roles (Cheng et al., arXiv:1901.08755, Sections 4-5; docs/vertical.md
§2): the guest (active party: labels, its own features, the key pair, the trees) and the hosts
(passive parties: features, bins, and a lookup table of their own split thresholds).

What each learns. A host receives [[g]], [[h]] (never plaintext), the instance ids of every
node it builds histograms for, and which of its own (feature, bucket) won a split; it keeps
the thresholds. The guest receives, per node and host, bucket sums over *opaque* feature ids
(a fresh permutation per node, so the guest cannot even link a host feature across nodes),
bucket counts with GH packing, one bit per opaque feature saying whether some instance of the
node lacks it (missing values: the guest then also scans that feature backward), the ids going
left at a host split, and at prediction one direction bit per (host node, instance). It stores
only (party, record id) for host splits; the host keeps (feature, threshold, default direction)
and applies the direction to its own missing values.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from fedloom.core.rng import numpy_rng
from fedloom.secure.paillier import PaillierKeypair
from fedloom.vertical.binning import QuantileCuts, goes_left
from fedloom.vertical.histograms import (
    DEFAULT_GH_FRAC_BITS,
    EncryptedGradients,
    HistogramKernel,
    HistogramPayload,
    HostHistogram,
    decode_histogram,
    encode_gradients,
)
from fedloom.vertical.messages import Channel, Party
from fedloom.vertical.tree import Candidate, Scan, TreeParams, scan_features


class _IdsMessage:
    """A message of two integers and an array of instance ids (the field ``ids_field``); on
    the wire 4 bytes each."""

    ids_field: ClassVar[str]

    @property
    def nbytes(self) -> int:
        ids: np.ndarray = getattr(self, self.ids_field)
        return 8 + int(ids.astype(np.int32).nbytes)


@dataclass(frozen=True)
class NodeRequest(_IdsMessage):
    """Guest -> host: build the histogram of node ``node_id`` (child of ``parent_id``) over
    the instances ``ids``."""

    ids_field: ClassVar[str] = "ids"
    node_id: int
    parent_id: int | None
    ids: np.ndarray


@dataclass(frozen=True)
class SplitRecord(_IdsMessage):
    """Host -> guest: the record id the host stored, the opaque feature it chose among the
    tied candidates, and the ids going left."""

    ids_field: ClassVar[str] = "left_ids"
    record_id: int
    opaque_feature: int
    left_ids: np.ndarray


@dataclass(frozen=True)
class HostCandidates:
    """What the guest learns from one host's histogram at one node: per opaque feature the
    best candidate (module ``tree``'s :class:`~fedloom.vertical.tree.Scan`), and the maximum."""

    scan: Scan

    def best(self) -> tuple[float, list[tuple[int, int, bool]]]:
        """The best loss_chg and every (opaque feature, bin, default_left) that reaches it."""
        chg = self.scan.loss_chg
        top = float(np.max(chg)) if chg.size else -np.inf
        tied = np.flatnonzero(chg == np.float32(top)) if np.isfinite(top) else []
        return top, [
            (int(j), int(self.scan.bins[j]), bool(self.scan.default_left[j])) for j in tied
        ]

    def candidate(self, opaque: int) -> Candidate:
        return self.scan.candidate(opaque)


class Host(Party):
    """A passive party: its feature block, its bins, its lookup table."""

    def __init__(
        self, name: str, channel: Channel, x: np.ndarray, max_bin: int, index: int, seed: int
    ) -> None:
        super().__init__(name, channel)
        self.x = np.asarray(x, dtype=np.float64)
        self.cuts = QuantileCuts.sketch(self.x, max_bin)
        self.bins = self.cuts.bin(self.x)
        self.index = index
        self.seed = seed
        self.lookup: dict[int, tuple[int, float, bool]] = {}
        """record id -> (feature, threshold, default_left): the host's half of every host
        split; the direction of its missing values stays with the host."""
        self._kernel: HistogramKernel | None = None
        self._hists: dict[int, HostHistogram] = {}
        self._ids: dict[int, np.ndarray] = {}
        self._perm: dict[int, np.ndarray] = {}
        self._tree = -1
        self.compress = True

    def receive_gradients(self, tree: int, gradients: EncryptedGradients) -> None:
        """A new tree: keep [[g]], [[h]] (or g, h in the plaintext path)."""
        self._kernel = HistogramKernel(gradients, compress=self.compress)
        self._hists, self._ids, self._perm = {}, {}, {}
        self._tree = tree

    def histograms(self, requests: list[NodeRequest]) -> list[HistogramPayload]:
        """Bucket sums for each requested node, features in a fresh opaque order. Siblings:
        the smaller is summed, the larger is parent − smaller (histogram subtraction)."""
        assert self._kernel is not None
        timer = self.channel.crypto() if self._kernel.kind != "plain" else nullcontext()
        with timer:
            return self._histograms(self._kernel, requests)

    def _histograms(
        self, kernel: HistogramKernel, requests: list[NodeRequest]
    ) -> list[HistogramPayload]:
        n_bins = self.cuts.max_bins
        for r in requests:
            self._ids[r.node_id] = r.ids
        by_parent: dict[int | None, list[NodeRequest]] = {}
        for r in requests:
            by_parent.setdefault(r.parent_id, []).append(r)
        for parent, group in by_parent.items():
            group = sorted(group, key=lambda r: len(r.ids))
            for i, r in enumerate(group):
                sibling_done = i > 0 and parent in self._hists
                if sibling_done:
                    self._hists[r.node_id] = kernel.subtract(
                        self._hists[parent], self._hists[group[0].node_id]
                    )
                else:
                    self._hists[r.node_id] = kernel.build(self.bins, r.ids, n_bins)
            self._hists.pop(parent, None)  # not needed any more
        out = []
        for r in requests:
            rng = numpy_rng(
                self.seed, f"secureboost_opaque:{r.node_id}", round=self._tree, client=self.index
            )
            perm = rng.permutation(self.x.shape[1])
            self._perm[r.node_id] = perm
            out.append(kernel.export(self._hists[r.node_id], perm))
        return out

    def split(self, node_id: int, tied: list[tuple[int, int, bool]]) -> SplitRecord:
        """Store the split the guest chose (among tied candidates, the lowest true feature
        index: XGBoost's tie rule) with its default direction, return its record id and the
        ids going left (missing values: the default direction)."""
        perm = self._perm[node_id]
        opaque, bin_index, default_left = min(tied, key=lambda t: int(perm[t[0]]))
        feature = int(perm[opaque])
        threshold = self.cuts.threshold(feature, bin_index, default_left)
        record_id = len(self.lookup)
        self.lookup[record_id] = (feature, threshold, default_left)
        ids = self._ids[node_id]
        left = ids[goes_left(self.x[ids, feature], threshold, default_left)]
        return SplitRecord(record_id, opaque, left)

    def directions(self, x: np.ndarray, record_ids: list[int]) -> np.ndarray:
        """Prediction: for each asked record and each instance of ``x`` (the host's block of
        new rows), 1 if the instance goes left."""
        x = np.asarray(x)
        bits = np.zeros((len(record_ids), x.shape[0]), dtype=bool)
        for i, r in enumerate(record_ids):
            feature, threshold, default_left = self.lookup[r]
            bits[i] = goes_left(x[:, feature], threshold, default_left)
        return bits

    def to_dict(self) -> dict[str, Any]:
        """The host's model: its lookup table."""
        return {"party": self.index, "lookup": {r: list(v) for r, v in self.lookup.items()}}


@dataclass
class GradientEncoding:
    """How the guest ships g, h: ``plain``, ``separate`` or ``packed`` (module histograms)."""

    kind: str
    keypair: PaillierKeypair | None = None
    frac_bits: int = DEFAULT_GH_FRAC_BITS
    g_offset: float = 1.0
    layouts: dict[int, Any] = field(default_factory=dict)


class Guest(Party):
    """The active party: labels, its own features and bins, the key pair, the trees."""

    def __init__(
        self,
        name: str,
        channel: Channel,
        x: np.ndarray,
        y: np.ndarray,
        max_bin: int,
        params: TreeParams,
        encoding: GradientEncoding,
    ) -> None:
        super().__init__(name, channel)
        self.x = np.asarray(x, dtype=np.float64)
        self.y = y
        self.cuts = QuantileCuts.sketch(self.x, max_bin)
        self.bins = self.cuts.bin(self.x)
        self.params = params
        self.encoding = encoding
        self._own: HistogramKernel | None = None
        self._gradients: EncryptedGradients | None = None

    def gradients_message(self, g: np.ndarray, h: np.ndarray) -> EncryptedGradients:
        """[[g]], [[h]] (or the packed [[gh]]) for the hosts; the guest keeps g, h itself."""
        enc = self.encoding
        self._own = HistogramKernel(encode_gradients("plain", g, h))
        if enc.kind == "packed" and enc.keypair is not None:
            top = float(np.max(np.abs(g))) if g.size else 1.0
            enc.g_offset = float(2.0 ** np.ceil(np.log2(max(top, 1.0))))
        key = enc.keypair.public_key if enc.keypair else None
        with self.channel.crypto():
            self._gradients = encode_gradients(
                enc.kind, g, h, public_key=key, frac_bits=enc.frac_bits, g_offset=enc.g_offset
            )
        return self._gradients

    def own_candidate(self, ids: np.ndarray, node_g: float, node_h: float) -> Candidate | None:
        """The best split over the guest's own features (plain histograms)."""
        assert self._own is not None
        hist = self._own.build(self.bins, ids, self.cuts.max_bins)
        channels = hist.channels
        return scan_features(
            self.params, channels["g"], channels["h"], node_g, node_h, hist.missing
        ).best()

    def host_candidates(
        self, payload: HistogramPayload, node_g: float, node_h: float
    ) -> HostCandidates:
        """Decrypt (or read) a host's bucket sums and scan them."""
        enc, grads = self.encoding, self._gradients
        assert grads is not None
        with self.channel.crypto():
            hist_g, hist_h = decode_histogram(
                payload,
                enc.keypair.private_key if enc.keypair else None,
                frac_bits=enc.frac_bits,
                layout=grads.layout,
                g_offset=enc.g_offset,
            )
        return HostCandidates(
            scan_features(self.params, hist_g, hist_h, node_g, node_h, payload.missing)
        )

    def left_ids(
        self, ids: np.ndarray, feature: int, threshold: float, default_left: bool
    ) -> np.ndarray:
        return ids[goes_left(self.x[ids, feature], threshold, default_left)]
