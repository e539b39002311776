"""Client programs and the backends that run them (sequential, vmap), with the pieces local
solvers are made of. Above the core, below the algorithms.

The client-program API an algorithm builds on (solvers/program.py) is importable from here."""

from fedloom.solvers.program import (
    BATCHES,
    Batch,
    Carry,
    ClientProgram,
    ClientRun,
    CoveringPlans,
    Ops,
    Plan,
    RoundExtent,
    Update,
    UpdateFn,
)

__all__ = [
    "BATCHES",
    "Batch",
    "Carry",
    "ClientProgram",
    "ClientRun",
    "CoveringPlans",
    "Ops",
    "Plan",
    "RoundExtent",
    "Update",
    "UpdateFn",
]
