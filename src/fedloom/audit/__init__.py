"""Privacy audits of finished runs (issue #15; docs/audit.md): membership inference (the
loss-threshold attack of Yeom et al. 2018 and the shadow-model attack of Shokri et al. 2017)
on the global model and each client's deployed model, gradient inversion (DLG, iDLG, the
analytic first-layer recovery) against one client's minibatch gradient, and three
defences of personalized models with their cost (docs/audit.md, "The three defences").

The package is also the API function: ``fedloom.audit(run_dir, attack="loss", out=None,
...)`` calls :func:`fedloom.audit.auditor.audit` (a callable module, so that
``fedloom.audit.inversion`` and the function share the name without one hiding the other).
Importing it stays light (no scikit-learn, no plotly): the attacks load those when they run.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from fedloom.audit.metrics import Roc, attack_summary, psnr, rates, roc_curve


class _AuditPackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Audit a finished run: ``fedloom.audit(run_dir, attack='loss', out=None, ...)``;
        see :func:`fedloom.audit.auditor.audit`."""
        from fedloom.audit.auditor import audit

        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _AuditPackage

__all__ = ["Roc", "attack_summary", "psnr", "rates", "roc_curve"]
