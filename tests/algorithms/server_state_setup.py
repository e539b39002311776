"""The pieces the pFedMac and FPFC tests share (tests/algorithms/test_pfedmac.py, test_fpfc.py):
the server states their aggregates return, recorded during a run, and an algorithm built on a
small logistic-regression context without the engine."""

from __future__ import annotations

from fedloom.algorithms import build_algorithm
from fedloom.algorithms.base import AlgorithmContext
from fedloom.algorithms.fpfc import FPFC
from fedloom.algorithms.pfedmac import PFedMac
from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import weighted_average
from fedloom.models import build_model
from fedloom.solvers.local import PlanMaker


def recorded_servers(monkeypatch) -> list[tuple]:
    """Records (algorithm, server state) after every aggregate of pFedMac and FPFC: the engine
    does not hand the final server state back (see summary_extras)."""
    seen: list[tuple] = []
    for cls in (PFedMac, FPFC):
        original = cls.aggregate

        def recording(self, server, results, original=original):
            out = original(self, server, results)
            seen.append((self, out))
            return out

        monkeypatch.setattr(cls, "aggregate", recording)
    return seen


def make_algorithm(raw: dict, m: int, dim: int = 3) -> tuple:
    model = FunctionalModel(build_model("logreg", (dim,), 2), "classification")
    ctx = AlgorithmContext(
        model=model,
        seed=0,
        num_clients=m,
        lr=0.1,
        batch_size=None,
        aggregate=weighted_average,
        make_plan=PlanMaker(0, None),
        population={i: 10 + i for i in range(m)},
    )
    params, buffers = model.initial_state(0)
    return build_algorithm(raw, ctx), params, buffers
