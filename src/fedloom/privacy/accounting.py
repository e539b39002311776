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


Exposure = tuple[float, int]
"""(sample_rate, steps) of one client's data under sample-level DP."""


def frontier(exposures: Sequence[Exposure]) -> list[Exposure]:
    """The exposures no other one dominates (another with a sample rate and a step count both
    at least as large spends at least as much privacy): the only ones whose epsilon can be the
    largest."""
    out: list[Exposure] = []
    for q, t in sorted(set(exposures), key=lambda e: (-e[0], -e[1])):
        if t > 0 and (not out or t > out[-1][1]):
            out.append((q, t))
    return out


def worst_epsilon(
    noise_multiplier: float, exposures: Sequence[Exposure], delta: float, accountant: str = "rdp"
) -> tuple[float, Exposure | None]:
    """The largest epsilon among the exposures (each its own accountant history of one
    phase), and the exposure that reaches it (None when no data was touched)."""
    worst, at = 0.0, None
    for q, t in frontier(exposures):
        eps = epsilon([(noise_multiplier, q, t)], delta, accountant)
        if at is None or eps > worst:
            worst, at = eps, (q, t)
    return worst, at


def noise_multiplier_for_all(
    target_epsilon: float, delta: float, exposures: Sequence[Exposure], accountant: str = "rdp"
) -> float:
    """The smallest noise multiplier (to Opacus's 0.01 bisection) that keeps every exposure
    within ``target_epsilon``: each exposure's own calibration, the largest of them. The
    binding exposure is found first (the worst at a first guess) and the others checked
    against it, so most runs calibrate once."""
    points = frontier(exposures)
    if not points:
        raise ConfigError("privacy.target_epsilon: no client takes a step, nothing to calibrate")
    q, t = max(points, key=lambda e: epsilon([(1.0, e[0], e[1])], delta, accountant))
    sigma = noise_multiplier_for(target_epsilon, delta, q, t, accountant)
    done = {(q, t)}
    while True:
        eps, at = worst_epsilon(sigma, points, delta, accountant)
        if eps <= target_epsilon or at is None or at in done:
            return sigma
        done.add(at)
        sigma = max(sigma, noise_multiplier_for(target_epsilon, delta, at[0], at[1], accountant))
