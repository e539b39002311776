"""The vmap backend's in-place SGD step (FuncOps(in_place=True).descend): it writes into the
parameters it is handed only where that is safe, and gives the out-of-place numbers."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

import fedloom
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.models import MLP
from fedloom.solvers.ops import AUTOGRAD, FUNC, FUNC_IN_PLACE, FuncOps
from tests.engine.test_executor_equivalence import assert_same, config


def _trees(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 3, 5, generator=gen), "b": torch.randn(4, 3, generator=gen)}
    grads = {"w": torch.randn(4, 3, 5, generator=gen)}  # "b" has no gradient: unchanged
    return params, grads


@pytest.mark.parametrize("lr", [0.1, torch.tensor(0.1)])
def test_in_place_descend_under_vmap_writes_into_the_stack_and_equals_out_of_place(lr):
    params, grads = _trees()
    expected = {"w": params["w"] - 0.1 * grads["w"], "b": params["b"].clone()}
    before = params["w"].data_ptr()
    out = vmap(lambda p, g: FUNC_IN_PLACE.descend(p, g, lr), in_dims=(0, 0))(params, grads)
    assert params["w"].data_ptr() == before
    torch.testing.assert_close(params["w"], expected["w"])  # written in place
    torch.testing.assert_close(out["w"], expected["w"])
    torch.testing.assert_close(out["b"], expected["b"])


def test_proximal_descend_in_place_and_out_of_place_agree_with_the_formula():
    """w - lr (g + mu (w - anchor)) (Ditto (9), pFedMe (6)), lr mu > 1 as in pFedMe's
    defaults: both vmap variants and the one-client ops."""
    params, grads = _trees()
    anchor = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    lr, mu = 0.09, 15.0
    expected = {k: params[k] - lr * (grads[k] + mu * (params[k] - anchor[k])) for k in grads}
    out = AUTOGRAD.descend(dict(params), grads, lr, anchor, mu)
    torch.testing.assert_close(out["w"], expected["w"])
    torch.testing.assert_close(out["b"], params["b"])  # no gradient: unchanged, not pulled
    for ops in (FUNC, FUNC_IN_PLACE):
        copy = {k: v.clone() for k, v in params.items()}
        moved = vmap(lambda p, g, a, o=ops: o.descend(p, g, lr, a, mu), in_dims=(0, 0, 0))(
            copy, grads, anchor
        )
        torch.testing.assert_close(moved["w"], expected["w"])
        assert torch.equal(copy["w"], moved["w"]) == (ops is FUNC_IN_PLACE)


@pytest.mark.parametrize("ops", [AUTOGRAD, FUNC])
def test_out_of_place_ops_never_touch_their_inputs(ops):
    params, grads = _trees()
    kept = {k: v.clone() for k, v in params.items()}
    out = ops.descend(params, grads, 0.1)
    for k in params:
        assert torch.equal(params[k], kept[k])
    torch.testing.assert_close(out["w"], kept["w"] - 0.1 * grads["w"])


@pytest.mark.parametrize("algorithm", ["fedavg", "fedrep"])
def test_vectorized_rounds_step_in_place_unless_a_client_is_masked(algorithm, monkeypatch):
    """Unequal client sizes and stragglers. FedAvg's clients still stepping are always a
    prefix of the chunk: every step is in place. FedRep's body phase starts after a head phase
    as long as the client's epoch, so at some steps a chunk holds clients in either phase and
    the body update masks those still in the head phase: out of place there. The numbers
    equal the sequential executor's either way. (The 2NN is made non-sample-wise here, so
    FedAvg takes the vmap path instead of the stacked one: tests/solvers/test_stacked.py.)"""
    monkeypatch.setattr(MLP, "samplewise", False)
    seen: list[bool] = []
    original = FuncOps.descend

    def spy(self: FuncOps, params, grads, lr):  # type: ignore[no-untyped-def]
        seen.append(self.in_place)
        return original(self, params, grads, lr)

    seq = fedloom.run(config(algorithm, "mlp", {"kind": "sequential"}, 16), write=False)
    monkeypatch.setattr(FuncOps, "descend", spy)
    vec = fedloom.run(
        config(algorithm, "mlp", {"kind": "vectorized", "chunk_size": 3}, 16), write=False
    )
    assert_same(seq, vec)
    assert True in seen
    assert (False in seen) == (algorithm == "fedrep")


def test_fedavg_on_a_samplewise_model_runs_stacked_not_vmapped(monkeypatch):
    """The FedAvg family's program on the built-in 2NN: every step of the vectorized round is
    the stacked step (core/stacked.py), none a vmapped descend."""
    descends: list[bool] = []
    stacked: list[int] = []
    original_descend, original_step = FuncOps.descend, PlainSGDProgram.stacked_step

    def spy_descend(self: FuncOps, params, grads, lr):  # type: ignore[no-untyped-def]
        descends.append(self.in_place)
        return original_descend(self, params, grads, lr)

    def spy_step(self, carry, batches, shared):  # type: ignore[no-untyped-def]
        stacked.append(batches[0].x.shape[0])
        return original_step(self, carry, batches, shared)

    monkeypatch.setattr(FuncOps, "descend", spy_descend)
    monkeypatch.setattr(PlainSGDProgram, "stacked_step", spy_step)
    seq = fedloom.run(config("fedavg", "mlp", {"kind": "sequential"}, 16), write=False)
    vec = fedloom.run(
        config("fedavg", "mlp", {"kind": "vectorized", "chunk_size": 3}, 16), write=False
    )
    assert_same(seq, vec)
    assert stacked and max(stacked) == 3 and 1 in stacked  # chunks of 3, down to the last
    assert not descends
