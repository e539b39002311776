"""Quantization: fewer bits per entry.

- QSGD (Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
  Encoding", NeurIPS 2017, section 3.1): with s levels, entry v_i becomes
  ||v||_2 sign(v_i) xi_i / s, where xi_i = l + 1 with probability |v_i| s / ||v|| - l and l
  otherwise (l = floor(|v_i| s / ||v||)): unbiased, E[Q(v)] = v (Lemma 3.1). Sent: the norm
  (float32) and each signed level in [-s, s] as a fixed-width code of ceil(log2(2s + 1)) bits,
  packed (the paper's Elias coding of the sparse levels would be shorter; the fixed width is
  what this payload really uses). One norm per tensor (the paper's bucket = the tensor).
- int8: round(x / scale) in [-127, 127] with scale = max|x| / 127, one float32 scale per tensor
  (deterministic rounding: biased, error feedback corrects it).
- fp16: the entries as IEEE half floats (clamped to +-65504, half's largest finite value).
"""

from __future__ import annotations

import torch

from fedloom.compression.base import Scheme
from fedloom.compression.payload import Payload, bits_for, pack_bits, unpack_bits


class QSGD(Scheme):
    name = "qsgd"

    def __init__(self, levels: int) -> None:
        self.levels = levels
        self.bits = bits_for(2 * levels + 1)

    def encode(self, x: torch.Tensor, gen: torch.Generator) -> Payload:
        s = self.levels
        x64 = x.to(torch.float64)
        norm = x64.norm()
        scaled = x64.abs() * (s / norm) if norm > 0 else torch.zeros_like(x64)
        low = scaled.floor()
        u = torch.rand(x.numel(), generator=gen, dtype=torch.float64)
        level = (low + (u < scaled - low).to(torch.float64)).clamp(max=s).to(torch.int64)
        signed = torch.where(x64 < 0, -level, level)
        return Payload(
            {
                "norm": norm.to(torch.float32).reshape(1),
                "levels": pack_bits(signed + s, self.bits),
            }
        )

    def decode(self, payload: Payload, numel: int, gen: torch.Generator) -> torch.Tensor:
        s = self.levels
        signed = unpack_bits(payload.parts["levels"], self.bits, numel) - s
        norm = payload.parts["norm"].to(torch.float64)
        return (signed.to(torch.float64) * (norm / s)).to(torch.float32)


class Int8(Scheme):
    name = "int8"
    biased = True

    def encode(self, x: torch.Tensor, gen: torch.Generator) -> Payload:
        peak = x.abs().max() if x.numel() else x.new_zeros(())
        scale = (peak / 127).to(torch.float32)
        if not scale > 0:
            scale = torch.ones((), dtype=torch.float32)
        q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
        return Payload({"scale": scale.reshape(1), "values": q})

    def decode(self, payload: Payload, numel: int, gen: torch.Generator) -> torch.Tensor:
        return payload.parts["values"].to(torch.float32) * payload.parts["scale"]


HALF_MAX = float(torch.finfo(torch.float16).max)


class FP16(Scheme):
    name = "fp16"
    biased = True

    def encode(self, x: torch.Tensor, gen: torch.Generator) -> Payload:
        return Payload({"values": x.clamp(-HALF_MAX, HALF_MAX).to(torch.float16)})

    def decode(self, payload: Payload, numel: int, gen: torch.Generator) -> torch.Tensor:
        return payload.parts["values"].to(torch.float32)
