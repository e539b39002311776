"""The engine's compression of uploads (``compression.kind``): each client encodes what it
uploads, the server decodes it, and communication counts the encoded bytes.

Per uploaded tree (``params``, ``buffers``, SCAFFOLD's ``delta`` and ``control_delta``, ...):

- a tree that the server also broadcast under the same name (the model) is compressed as the
  update, upload minus broadcast, so that sparsifying it makes sense; the server adds the
  decoded update back to what it sent;
- any other tree (deltas, gradients, prototypes) is compressed as it is;
- integer tensors (BatchNorm's ``num_batches_tracked``) travel raw.

Error feedback (Seide et al., "1-bit SGD", Interspeech 2014; Stich et al., NeurIPS 2018,
Algorithm 1; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019): client k keeps the
residual e_k of what it did not send; each round it compresses c = u + e_k, sends
C(c) and keeps e_k <- c - C(c). So sum_t C(c_t) + e_k(T) = sum_t u_t: nothing is lost, only
delayed. It needs a contractive scheme (Stich & Karimireddy, "The Error-Feedback Framework",
2019: E||c - C(c)||^2 <= (1 - delta) ||c||^2): top-k, random-k without scaling, int8 and fp16
are; QSGD is unbiased but its variance can exceed ||c||^2, and with it the residual grows
every round (tests/compression/test_error_feedback.py), so it runs without. The residuals are
persistent per-client state: in checkpoints (``state_dict``), so a
resumed run equals an uninterrupted one. A non-finite upload (dropped by the engine's
screening afterwards) leaves its client's residual as it was.

Random draws (QSGD's rounding, random-k's indices) come from the stream
(seed, round, client, ``compression/<tree>/<tensor>``); the server's decoder derives the same
stream, which is how random-k's indices need not travel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fedloom.compression.base import Scheme
from fedloom.compression.quantize import FP16, QSGD, Int8
from fedloom.compression.sparsify import RandK, TopK
from fedloom.core.protocol import Message
from fedloom.core.pytree import Tree
from fedloom.core.rng import generator

if TYPE_CHECKING:
    from fedloom.compression.config import CompressionConfig


def build_scheme(config: CompressionConfig) -> Scheme:
    """The scheme ``compression.kind`` names."""
    kind = config.kind
    if kind == "topk":
        return TopK(config.ratio)
    if kind == "randk":
        return RandK(config.ratio, unbiased=not config.feedback())
    if kind == "qsgd":
        return QSGD(config.levels)
    if kind == "int8":
        return Int8()
    if kind == "fp16":
        return FP16()
    raise ValueError(f"no compression scheme {kind!r}")


class UploadCompression:
    """One run's upload compression: ``start_round`` with the broadcast, then ``transmit`` each
    client's upload (also callable on its own: ``(upload, client_id, round) -> upload``)."""

    def __init__(self, config: CompressionConfig, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.scheme = build_scheme(config)
        self.feedback = config.feedback()
        self.broadcast: Mapping[str, Any] = {}
        self.residual: dict[int, dict[str, Tree]] = {}
        """Error feedback's memory: client -> uploaded tree's name -> tensor name -> e_k."""
        self.bytes_encoded = 0
        self.bytes_dense = 0

    def start_round(self, round: int, message: Mapping[str, Any]) -> None:
        self.broadcast = message

    def __call__(self, upload: Message, client_id: int, round: int) -> Message:
        return self.transmit(upload, client_id, round)[0]

    def transmit(self, upload: Message, client_id: int, round: int) -> tuple[Message, int]:
        """(the upload as the server decodes it, its bytes on the wire)."""
        decoded: Message = {}
        sent = dense = 0
        memory = self.residual.get(client_id, {})
        kept: dict[str, Tree] = {}
        finite = True
        for name, tree in upload.items():
            reference = self._reference(name, tree)
            out: Tree = {}
            for key, value in tree.items():
                size = value.numel() * value.element_size()
                dense += size
                if not value.is_floating_point():  # travels raw
                    out[key], sent = value, sent + size
                    continue
                base = reference[key] if reference is not None else None
                update = value - base if base is not None else value
                c = update.detach().reshape(-1).to(torch.float32)
                previous = memory.get(name, {}).get(key)
                if self.feedback and previous is not None:
                    c = c + previous  # c = u + e_k
                got, nbytes = self._send(c, f"compression/{name}/{key}", client_id, round)
                sent += nbytes
                if self.feedback:
                    kept.setdefault(name, {})[key] = c - got  # e_k <- c - C(c)
                    finite = finite and bool(torch.isfinite(c).all())
                got = got.reshape(value.shape).to(value.dtype)
                out[key] = base + got if base is not None else got
            decoded[name] = out
        if self.feedback:
            self.residual[client_id] = kept if finite else memory
        self.bytes_encoded += sent
        self.bytes_dense += dense
        return decoded, sent

    def _send(
        self, c: torch.Tensor, stream: str, client: int, round: int
    ) -> tuple[torch.Tensor, int]:
        """(C(c) as the server decodes it, the payload's bytes): the client encodes with the
        stream (seed, round, client, ``stream``), the server decodes with the same stream."""
        payload = self.scheme.encode(c, generator(self.seed, stream, round, client))
        got = self.scheme.decode(payload, c.numel(), generator(self.seed, stream, round, client))
        return got, payload.nbytes

    def _reference(self, name: str, tree: Mapping[str, torch.Tensor]) -> Tree | None:
        """The broadcast tree that ``tree`` updates (same name, every key), else None."""
        sent = self.broadcast.get(name)
        if isinstance(sent, Mapping) and tree and all(k in sent for k in tree):
            return dict(sent)
        return None

    # -- state and report ---------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        cfg = self.config
        out: dict[str, Any] = {"kind": cfg.kind, "error_feedback": self.feedback}
        if cfg.kind in ("topk", "randk"):
            out["ratio"] = cfg.ratio
        if cfg.kind == "qsgd":
            out["levels"] = cfg.levels
        out["bytes_encoded"] = self.bytes_encoded
        out["bytes_dense"] = self.bytes_dense
        encoded = self.bytes_encoded
        out["compression_factor"] = self.bytes_dense / encoded if encoded else None
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "residual": self.residual,
            "bytes_encoded": self.bytes_encoded,
            "bytes_dense": self.bytes_dense,
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.residual = {int(c): dict(trees) for c, trees in saved.get("residual", {}).items()}
        self.bytes_encoded = int(saved.get("bytes_encoded", 0))
        self.bytes_dense = int(saved.get("bytes_dense", 0))
