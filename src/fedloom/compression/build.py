"""The compression mechanism of a run from its ``compression`` section (core/mechanism.py,
``Builder``)."""

from __future__ import annotations

from fedloom.compression.config import CompressionConfig
from fedloom.compression.mechanism import Compression
from fedloom.core.mechanism import BuildFacts


def build(section: CompressionConfig, facts: BuildFacts) -> Compression | None:
    """Upload and download compression (docs/compression.md); None when both are off."""
    if section.kind == "none" and section.download == "none":
        return None
    return Compression(section, facts.seed)
