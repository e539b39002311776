"""The report's figure slots in page order, from the general figures and the health panels."""

from __future__ import annotations

from fedloom.report import clock, figures, health, incentives, rl, vertical
from fedloom.report.figures import Panel
from fedloom.report.rundir import RunData, dig, num


def build_panels(run: RunData) -> list[Panel]:
    """All figure slots of the report, in page order, grouped as docs/monitoring.md's table
    (convergence health, personalization, heterogeneity, resources). The cold-start slot is
    there only for runs that hold clients out (``eval.new_clients`` > 0)."""
    if vertical.is_vertical(run):  # vertical and transfer runs: their own panels
        return vertical.build_panels(run)
    if rl.is_rl(run):  # reinforcement-learning runs: theirs (docs/rl.md)
        return rl.build_panels(run)
    held_out = num(dig(run.config, "eval", "new_clients")) or (run.summary or {}).get("cold_start")
    return [
        figures.accuracy_panel(run),
        *([clock.clock_panel(run)] if clock.has_clock(run) else []),
        figures.loss_panel(run),
        health.update_norm_panel(run),
        health.cosine_panel(run),
        figures.client_accuracy_panel(run),
        *([figures.cold_start_panel(run)] if held_out else []),
        health.heterogeneity_panel(run),
        health.client_heterogeneity_panel(run),
        figures.label_histogram_panel(run.label_histogram),
        figures.communication_panel(run),
        health.resources_panel(run),
        *([health.privacy_panel(run)] if health.has_privacy(run) else []),
        *([health.secure_aggregation_panel(run)] if health.has_secure_aggregation(run) else []),
        *([health.attack_panel(run)] if health.has_attack(run) else []),
        *incentives.build_panels(run),
    ]
