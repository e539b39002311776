"""Privacy accounting through Opacus (no hand-written accounting).

A run's privacy loss is a list of phases ``(noise_multiplier, sample_rate, steps)`` of the
subsampled Gaussian mechanism (Opacus's accountant ``history``); client-level DP-FedAvg is one
phase with one step per round. ``accountant`` is Opacus's ``rdp`` (Renyi DP, Mironov 2017) or
``prv`` (privacy random variables, Gopi et al. 2021; tighter).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedloom.errors import ConfigError

Phase = tuple[float, float, int]
"""(noise_multiplier, sample_rate, steps)."""


def _opacus():  # type: ignore[no-untyped-def]
    try:
        from opacus.accountants import create_accountant
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:  # pragma: no cover - the test extra installs it
        raise ConfigError(
            "privacy needs Opacus for its accounting: pip install 'fedloom[privacy]'"
        ) from None
    return create_accountant, get_noise_multiplier


def epsilon(history: Sequence[Phase], delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after the phases of ``history`` (Opacus ``get_epsilon``); 0 for an
    empty history or zero steps; infinity when a phase adds no noise."""
    phases = [(float(z), float(q), int(t)) for z, q, t in history if t > 0]
    if not phases:
        return 0.0
    if any(z == 0.0 for z, _, _ in phases):
        return float("inf")
    create_accountant, _ = _opacus()
    acc = create_accountant(mechanism=accountant)
    acc.history = phases
    return float(acc.get_epsilon(delta=delta))


def noise_multiplier_for(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """The smallest noise multiplier whose ``steps`` steps at ``sample_rate`` stay within
    ``target_epsilon`` (Opacus ``get_noise_multiplier``, its bisection to 0.01 precision)."""
    _, get_noise_multiplier = _opacus()
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
        )
    )
