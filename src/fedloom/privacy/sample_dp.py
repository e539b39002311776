"""Sample-level DP-SGD in every client (Abadi et al., CCS 2016): the mechanism's settings,
calibration and accounting. The clipping and noising happen in the clients' local steps
(solvers/dpsgd.py), which run on either backend.

Client k takes its local steps on Poisson minibatches of its n_k samples at rate
q_k = min(1, B / n_k) (B = ``train.batch_size``; expected size q_k n_k), each step the
subsampled Gaussian mechanism with noise multiplier sigma on its data. Client k's samples are
exposed only in the steps client k takes, so after T_k steps its guarantee is Opacus's epsilon
of (sigma, q_k, T_k); the run reports the largest epsilon over the clients (the guarantee that
holds for every sample of every client). Client sampling across rounds is not counted as
amplification: a conservative bound.

``target_epsilon`` calibrates sigma so that the largest epsilon after the whole run stays within
it, assuming every client takes part in every round (an upper bound on T_k).

Threat model (docs/privacy.md): the server and everyone who sees what a client uploads or any
model released from it; the client itself is trusted with its raw data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fedloom.core.mechanism import Mechanism
from fedloom.core.protocol import ClientTask
from fedloom.privacy.accounting import Exposure, noise_multiplier_for_all, worst_epsilon
from fedloom.privacy.config import PrivacyConfig
from fedloom.solvers.dpsgd import DPSGD


def sample_rate(batch_size: int | None, n: int) -> float:
    """q_k = min(1, B / n_k) (full batch: 1)."""
    return 1.0 if batch_size is None or n == 0 else min(1.0, batch_size / n)


class SampleLevelDP(Mechanism):
    """DP-SGD's settings for the clients (``dpsgd``) and the accountant of the steps they
    take (``on_dispatch`` records them; ``privacy_spent``). The clipping and noise happen in
    the clients' private steps (solvers/ops.py), so as a mechanism of the round it only
    counts."""

    key = "privacy"

    def __init__(
        self,
        config: PrivacyConfig,
        population: Mapping[int, int],
        batch_size: int | None,
        max_steps: Mapping[int, int],
    ) -> None:
        """``population``: training samples per training client; ``max_steps``: an upper bound
        on each client's local steps over the whole run (for ``target_epsilon``)."""
        self.config = config
        self.rates = {c: sample_rate(batch_size, n) for c, n in population.items()}
        if config.noise_multiplier is not None:
            self.noise_multiplier = float(config.noise_multiplier)
        else:
            assert config.target_epsilon is not None
            self.noise_multiplier = noise_multiplier_for_all(
                config.target_epsilon,
                config.delta,
                [(self.rates[c], t) for c, t in max_steps.items()],
                config.accountant,
            )
        self.dpsgd = DPSGD(float(config.clip), self.noise_multiplier, batch_size)
        self.steps: dict[int, int] = {}
        """Local steps each client has taken so far."""

    def record(self, steps: Mapping[int, int]) -> None:
        """Count a round's local steps per client."""
        for c, t in steps.items():
            self.steps[c] = self.steps.get(c, 0) + int(t)

    def exposures(self) -> list[Exposure]:
        return [(self.rates[c], t) for c, t in self.steps.items()]

    # -- the mechanism protocol (core/mechanism.py) -------------------------------------------
    def on_dispatch(self, round: int, tasks: Sequence[ClientTask]) -> None:
        """Each dispatched client's data is exposed once per local step it takes."""
        self.record({t.client_id: len(t.plan) for t in tasks})

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the steps taken per client (JSON keys)."""
        return {"steps": {str(c): t for c, t in sorted(self.steps.items())}}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.steps = {int(c): int(t) for c, t in saved.get("steps", {}).items()}

    def privacy_spent(self) -> dict[str, Any]:
        """The largest epsilon over the clients so far (null when no noise is added)."""
        eps, at = worst_epsilon(
            self.noise_multiplier, self.exposures(), self.config.delta, self.config.accountant
        )
        return {
            "epsilon": eps if math.isfinite(eps) else None,
            "delta": self.config.delta,
            "sample_rate": at[0] if at else None,
            "steps": at[1] if at else 0,
        }

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` section: the worst client's epsilon and its exposure."""
        return {
            **self.privacy_spent(),
            "kind": "sample_dp",
            "accountant": self.config.accountant,
            "noise_multiplier": self.noise_multiplier,
            "clip": self.config.clip,
            "clients_accounted": len(self.steps),
        }
