"""What one compressed tensor travels as: a :class:`Payload` of plain tensors whose raw bytes
are what communication counts, and the bit packing that keeps quantized levels honest (a
3-bit level takes 3 bits on the wire, not a byte)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Payload:
    """The encoded form of one tensor: named parts (values, indices, packed levels, scales).
    The tensor's shape and dtype are not sent: both sides know the model's architecture."""

    parts: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the raw bytes of every part."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest signed integer type that holds every index of a tensor of ``numel``
    entries (int16 up to 32,768 entries, then int32, then int64)."""
    if numel <= 1 << 15:
        return torch.int16
    if numel <= 1 << 31:
        return torch.int32
    return torch.int64


def bits_for(values: int) -> int:
    """Bits of a fixed-width code for ``values`` distinct symbols (at least 1)."""
    return max(1, (values - 1).bit_length())


_BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.int64)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (integers in [0, 2**bits)) as a little-endian bit stream in uint8 bytes:
    ceil(len(codes) * bits / 8) bytes."""
    codes = codes.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((codes[:, None] >> shifts) & 1).reshape(-1)  # bit i of code c at c * bits + i
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    return (stream.reshape(-1, 8) * _BIT_WEIGHTS).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """``pack_bits``' inverse: the first ``count`` codes (int64)."""
    stream = ((packed.to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1)
    stream = stream[: count * bits].reshape(count, bits)
    return (stream << torch.arange(bits, dtype=torch.int64)).sum(dim=1)
