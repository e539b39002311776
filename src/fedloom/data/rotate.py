"""Rotate image batches by an angle: the feature-shift ("rotated MNIST") client transform.

Rotated MNIST as a clustered federated benchmark: Ghosh et al., "An Efficient Framework for
Clustered Federated Learning" (IFCA), NeurIPS 2020.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rotate_images(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate images ``x`` of shape (n, C, H, W) counter-clockwise by ``degrees``.

    Multiples of 90 use the exact ``torch.rot90``; other angles resample bilinearly around the
    image centre (``affine_grid``/``grid_sample``, zeros outside the original image).
    """
    if x.ndim != 4:
        raise ValueError(f"rotate_images expects (n, C, H, W) images, got shape {tuple(x.shape)}")
    quarter = degrees / 90.0
    if float(quarter).is_integer():
        return torch.rot90(x, int(quarter) % 4, dims=(-2, -1))
    return rotate_bilinear(x, degrees)


def rotate_bilinear(x: torch.Tensor, degrees: float) -> torch.Tensor:
    """Counter-clockwise rotation of (n, C, H, W) images by resampling (any angle)."""
    theta = math.radians(degrees)
    cos, sin = math.cos(theta), math.sin(theta)
    # Output pixel (u, v) samples the input at R(theta) (u, v): a counter-clockwise turn in
    # image coordinates, where the row axis points down (matches torch.rot90 at 90 degrees).
    h, w = x.shape[-2:]
    mat = torch.tensor([[cos, -sin * h / w, 0.0], [sin * w / h, cos, 0.0]], dtype=torch.float32)
    mat = mat.unsqueeze(0).expand(x.shape[0], 2, 3)
    grid = F.affine_grid(mat, list(x.shape), align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.to(x.dtype)
