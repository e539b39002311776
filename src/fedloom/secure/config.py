"""The ``secure_aggregation`` section of a run config (docs/secure_aggregation.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedloom.core.settings import StrictModel


class SecureAggregationConfig(StrictModel):
    """Secure aggregation (docs/secure_aggregation.md): the server learns the weighted sum of
    the clients' model updates and nothing else. Each client sends [w_k Delta_k, w_k], w_k its
    sample count over the round's largest, every coordinate clipped to [-clip, clip].

    - ``secagg``: SecAgg (Bonawitz et al. 2017), pairwise masks between all clients;
    - ``secagg_plus``: SecAgg+ (Bell et al. 2020), masks between ``neighbours`` per client;
    - ``paillier``: Paillier encryption, slot-packed, decrypted by a key authority;
    - ``ckks``: TenSEAL's CKKS, approximate."""

    kind: Literal["none", "secagg", "secagg_plus", "paillier", "ckks"] = "none"
    clip: float = Field(default=8.0, gt=0.0)
    """Every coordinate of a client's weighted update is clipped to [-clip, clip] before it is
    encoded (SecAgg's quantization range, Paillier's fixed-point offset)."""
    bits: int = Field(default=22, ge=2, le=31)
    """secagg, secagg_plus: quantization bits b (the sum of max_clients values fits Z_2^32)."""
    max_clients: int = Field(default=1000, ge=2)
    """secagg, secagg_plus: the most clients a round may hold (max_clients (2^b - 1) < 2^32);
    paillier: sizes the packing slots."""
    threshold: int | None = Field(default=None, ge=2)
    """secagg, secagg_plus: the clients (SecAgg+: the neighbours) that must survive for the
    round to finish (null: a strict majority)."""
    neighbours: int | None = Field(default=None, ge=2)
    """secagg_plus: each client's neighbours k, even (null: the smallest even >= 3 log2 n)."""
    key_bits: int = Field(default=2048, ge=512)
    """paillier: modulus bits (1024 for tests only, 2048 about 112-bit security, 3072
    128-bit)."""
    frac_bits: int = Field(default=16, ge=1, le=52)
    """paillier: fixed-point fractional bits f (resolution 2^-f)."""
    min_contributors: int = Field(default=2, ge=1)
    """paillier, ckks: the key authority decrypts no aggregate of fewer clients."""

    @model_validator(mode="after")
    def _keys_of_kind(self) -> SecureAggregationConfig:
        own = {
            "bits": {"secagg", "secagg_plus"},
            "max_clients": {"secagg", "secagg_plus", "paillier"},
            "threshold": {"secagg", "secagg_plus"},
            "neighbours": {"secagg_plus"},
            "key_bits": {"paillier"},
            "frac_bits": {"paillier"},
            "min_contributors": {"paillier", "ckks"},
        }
        fields = type(self).model_fields
        for key, kinds in own.items():  # a value other than the default, for another kind
            if self.kind not in kinds and getattr(self, key) != fields[key].default:
                raise ValueError(
                    f"{key} applies to kind {' or '.join(sorted(kinds))}, not {self.kind}"
                )
        if self.neighbours is not None and self.neighbours % 2:
            raise ValueError(
                f"neighbours must be even (a k-regular Harary graph), got {self.neighbours}"
            )
        return self
