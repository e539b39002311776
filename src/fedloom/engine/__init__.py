"""The engine: round loop, executors, local solver, evaluation, run directory."""
