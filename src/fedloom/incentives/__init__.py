"""Incentives and contribution evaluation (docs/incentives.md): Shapley
value estimators over any cooperative game (``shapley``: exact, leave-one-out, TMC, GTG),
FLI's payments with regret and waiting queues (``fli``), its baselines on the same
budget (``baselines``), declared costs (``costs``), fairness metrics (``fairness``) and a
run's book of all schemes side by side (``book``). The engine values each round's clients
and pays them through engine/contribution.py."""
