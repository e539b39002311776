"""The ``compression`` section of a run config (docs/compression.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedloom.core.settings import StrictModel
from fedloom.errors import ConfigError


class CompressionConfig(StrictModel):
    """Compression of the uploads (docs/compression.md): what each client sends is encoded,
    communication counts the encoded bytes, the server decodes."""

    kind: Literal["none", "topk", "randk", "qsgd", "fp16", "int8"] = "none"
    ratio: float = Field(default=0.01, gt=0.0, le=1.0)
    """topk, randk: the fraction of each tensor's entries sent."""
    error_feedback: bool | None = None
    """Keep what was not sent per client and add it to the next upload. null: on for the
    contractive schemes (topk, randk, int8, fp16), off for qsgd, whose variance makes the
    residual grow without bound (it cannot be turned on there)."""
    levels: int = Field(default=16, ge=1, le=2**15)
    """qsgd: quantization levels s."""
    download: Literal["none", "fp16", "int8"] = "none"
    """The broadcast model as fp16 or int8 (clients train from the decoded model)."""

    @model_validator(mode="after")
    def _feedback_applies(self) -> CompressionConfig:
        if self.kind == "qsgd" and self.error_feedback:
            raise ConfigError(
                "compression.error_feedback: true does not apply to qsgd: it is unbiased but not "
                "contractive (variance up to sqrt(d)/s times the update's), so the residual "
                "would grow every round; leave it null or false (docs/compression.md)"
            )
        return self

    def feedback(self) -> bool:
        """Whether error feedback is on (``error_feedback``, else on for all but qsgd)."""
        return self.error_feedback if self.error_feedback is not None else self.kind != "qsgd"
