"""Communication compression (docs/compression.md): top-k and random-k sparsification with
error feedback (``sparsify``), QSGD, int8 and fp16 quantization (``quantize``), each encoding a
tensor into a real :class:`~fedloom.compression.payload.Payload` whose bytes are what
communication counts; ``uploads`` applies the chosen scheme to every client's upload (the
engine's upload transform), with error feedback's per-client residuals; ``downloads`` sends the
broadcast model as fp16 or int8."""

from fedloom.compression.base import Scheme
from fedloom.compression.payload import Payload
from fedloom.compression.uploads import UploadCompression, build_scheme

__all__ = ["Payload", "Scheme", "UploadCompression", "build_scheme"]
