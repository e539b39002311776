"""A run's compression as one mechanism (core/mechanism.py; docs/compression.md): each client
encodes its upload as its last step (``compression.kind``: the encoded bytes count, the server
decodes before screening), and the server broadcasts its model encoded
(``compression.download``: the clients train from what they decode)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedloom.compression.downloads import DownloadCompression
from fedloom.compression.uploads import UploadCompression
from fedloom.core.mechanism import Mechanism
from fedloom.core.protocol import ClientResult, Message

if TYPE_CHECKING:
    from fedloom.compression.config import CompressionConfig


class Compression(Mechanism):
    """Upload compression (``upload``; error feedback's residuals are its state) and download
    compression (``download``), each None when off."""

    key = "compression"

    def __init__(self, config: CompressionConfig, seed: int) -> None:
        self.upload = UploadCompression(config, seed) if config.kind != "none" else None
        download = config.download
        self.download = DownloadCompression(download) if download != "none" else None

    def start_round(self, round: int, message: Message) -> None:
        if self.upload is not None:
            self.upload.start_round(round, message)

    def broadcast(self, message: Message) -> Message:
        return self.download.transmit(message) if self.download is not None else message

    def download_bytes(self, dense: int) -> int:
        return self.download.download_bytes(dense) if self.download is not None else dense

    def on_send(self, result: ClientResult, size: int, round: int) -> int:
        """The encoded size counts; ``result.upload`` becomes what the server decodes."""
        if self.upload is None:
            return size
        result.upload, encoded = self.upload.transmit(result.upload, result.client_id, round)
        return encoded

    def state_dict(self) -> dict[str, Any]:
        return self.upload.state_dict() if self.upload is not None else {}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        if self.upload is not None:
            self.upload.load_state_dict(saved)

    def summary(self) -> dict[str, Any]:
        return {
            **(self.upload.summary() if self.upload is not None else {}),
            **(self.download.summary() if self.download is not None else {}),
        }
