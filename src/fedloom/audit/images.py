"""Images as self-contained PNG data URIs for the audit page (stdlib zlib, no imaging
library)."""

from __future__ import annotations

import base64
import math
import struct
import zlib

import torch


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bytes(image: torch.Tensor, data_range: float = 1.0) -> bytes:
    """An 8-bit PNG of ``image``: (H, W) or (1, H, W) grey, (3, H, W) RGB, or a flat vector of
    a square number of pixels; values in [0, data_range], clipped."""
    img = image.detach().to(torch.float64).cpu()
    if img.ndim == 1:
        side = math.isqrt(img.numel())
        if side * side != img.numel():
            raise ValueError(f"cannot show a vector of {img.numel()} values as a square image")
        img = img.view(side, side)
    if img.ndim == 3 and img.shape[0] == 1:
        img = img[0]
    if img.ndim == 2:
        colour, pixels = 0, img.unsqueeze(-1)
    elif img.ndim == 3 and img.shape[0] == 3:
        colour, pixels = 2, img.permute(1, 2, 0)
    else:
        raise ValueError(f"cannot show a tensor of shape {tuple(image.shape)} as an image")
    data = (pixels / data_range).clamp(0, 1).mul(255).round().to(torch.uint8)
    height, width = data.shape[:2]
    raw = b"".join(b"\x00" + data[r].contiguous().numpy().tobytes() for r in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


def png_data_uri(image: torch.Tensor, data_range: float = 1.0) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image, data_range)).decode()
