"""Vertical and transfer federated learning (docs/vertical.md):

- :class:`VerticalLinear`, :class:`VerticalLogistic`: secure vertical linear and logistic
  regression (Yang et al. 2019; Hardy et al. 2017), three-party (coordinator) or two-party;
- :class:`SecureBoost`: gradient-boosted trees over vertically split features (Cheng et al.),
  equal to XGBoost's ``hist`` booster in its plaintext path;
- :class:`FederatedTransfer` (alias ``FTL``): federated transfer learning (Liu et al.), AHE or
  secret sharing.

Each runs as role objects exchanging explicit, recorded messages (``transcript_``); ``fit``
takes the parties' blocks guest first and returns the model. Names load lazily, so that the
API can read a vertical config without importing ``phe``, ``xgboost`` or ``torch``.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedloom.vertical.ftl import FederatedTransfer
    from fedloom.vertical.linear_model import VerticalLinear, VerticalLogistic
    from fedloom.vertical.secureboost import SecureBoost

    FTL = FederatedTransfer

_LAZY = {
    "SecureBoost": "fedloom.vertical.secureboost",
    "VerticalLinear": "fedloom.vertical.linear_model",
    "VerticalLogistic": "fedloom.vertical.linear_model",
    "FederatedTransfer": "fedloom.vertical.ftl",
    "FTL": "fedloom.vertical.ftl",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fedloom.vertical' has no attribute {name!r}")
    module = import_module(_LAZY[name])
    return getattr(module, "FederatedTransfer" if name == "FTL" else name)


__all__ = ["FTL", "FederatedTransfer", "SecureBoost", "VerticalLinear", "VerticalLogistic"]
