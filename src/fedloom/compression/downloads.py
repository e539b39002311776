"""Compression of the broadcast (``compression.download``): the model the server sends (the
message's ``params``) as fp16 or int8 (one scale per tensor), which every client decodes and
trains from; the rest of the message (buffers, control variates, hyperparameters) travels as
it is, and the server's own state stays in full precision.

Only these two make sense for downloads: sparsifying or stochastically quantizing the model
itself discards most of it, and sending compressed model *differences* would need every client
to hold the previous model, which partial participation breaks (docs/compression.md,
Downloads)."""

from __future__ import annotations

from typing import Any

import torch

from fedloom.compression.base import Scheme
from fedloom.compression.quantize import FP16, Int8
from fedloom.core.protocol import Message

DOWNLOAD_SCHEMES: dict[str, type[Scheme]] = {"fp16": FP16, "int8": Int8}


class DownloadCompression:
    """One run's broadcast compression: ``transmit`` the round's message."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.scheme = DOWNLOAD_SCHEMES[kind]()
        self._gen = torch.Generator()  # both schemes are deterministic: never drawn from
        self.last_encoded = 0
        self.last_dense = 0

    def transmit(self, message: Message) -> Message:
        """The message as each client decodes it; ``last_encoded`` and ``last_dense`` are its
        bytes on the wire and uncompressed."""
        out: Message = {}
        encoded = dense = 0
        for name, tree in message.items():
            decoded: dict[str, torch.Tensor] = {}
            for key, value in tree.items():
                size = value.numel() * value.element_size()
                dense += size
                if name != "params" or not value.is_floating_point():
                    decoded[key], encoded = value, encoded + size
                    continue
                payload = self.scheme.encode(value.detach().reshape(-1).float(), self._gen)
                encoded += payload.nbytes
                flat = self.scheme.decode(payload, value.numel(), self._gen)
                decoded[key] = flat.reshape(value.shape).to(value.dtype)
            out[name] = decoded
        self.last_encoded, self.last_dense = encoded, dense
        return out

    def download_bytes(self, dense_total: int) -> int:
        """The round's bytes down as encoded, from the dense count the algorithm gives (each
        client the whole message: clients x encoded; an algorithm that sends each client a
        part: the same share of it)."""
        if not self.last_dense:
            return dense_total
        clients, rest = divmod(dense_total, self.last_dense)
        if rest == 0:
            return clients * self.last_encoded
        return round(dense_total * self.last_encoded / self.last_dense)

    def summary(self) -> dict[str, Any]:
        return {"download": self.kind}
