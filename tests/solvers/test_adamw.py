"""``train.optimizer: adamw`` (solvers/adamw.py, docs/optimizers.md): the functional AdamW
step equals ``torch.optim.AdamW`` on one client (``MATCH``) in each of its forms (the lean trainer,
the pure step, under vmap, stacked); runs on the sequential and vectorized backends agree
(1e-4); moments kept in the client state (``moments: client``) carry over rounds and survive a
resume; the configs it cannot apply to are refused naming the algorithm."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import vmap

import fedloom
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.errors import ConfigError
from fedloom.models import build_model
from fedloom.solvers.adamw import AdamW, adamw_stacked_, adamw_step, init_moments
from fedloom.solvers.local import local_sgd
from tests.engine.test_executor_equivalence import assert_same
from tests.engine.test_executor_equivalence import config as equivalence_config
from tests.resume import killed_and_resumed

OPT = AdamW(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
LR, STEPS = 0.01, 6
MATCH = 1e-5
"""Largest parameter difference from ``torch.optim.AdamW`` after STEPS steps. Not 1e-6: Adam
divides by sqrt(v) + eps (eps 1e-6 here), so a gradient entry near zero, summed in another
order by the functional forward, moves its step by up to ~1e-6 (seen: 1.07e-6 on fc1.weight).
A wrong formula is far off: one step's weight decay is lr * 0.1 * |p| ~ 1e-4, and a missing
bias correction changes the first step by lr ~ 1e-2."""


def model_and_data() -> tuple[FunctionalModel, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model = FunctionalModel(build_model("mlp", (1, 8, 8), 5), "classification")
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(40, 1, 8, 8, generator=g), torch.randint(0, 5, (40,), generator=g)
    plan = [torch.randperm(40, generator=g)[:8] for _ in range(STEPS)]
    return model, x, y, plan


def torch_adamw(
    model: FunctionalModel,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    plan: list[torch.Tensor],
    keys: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The reference: ``torch.optim.AdamW`` on a copy of the module (only ``keys`` given to
    it), the model's mean loss on each minibatch of ``plan``."""
    module = copy.deepcopy(model.module)
    module.load_state_dict(params, strict=False)
    named = dict(module.named_parameters())
    trained = [named[k] for k in (keys or list(named))]
    opt = torch.optim.AdamW(
        trained, lr=LR, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    for idx in plan:
        opt.zero_grad()
        model.loss_from_output(module(x[idx]), y[idx]).backward()
        opt.step()
    return {k: p.detach() for k, p in named.items()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= tol, k


def test_lean_trainer_adamw_equals_torch_adamw_and_continues_from_its_moments():
    model, x, y, plan = model_and_data()
    params, buffers = model.initial_state(0)
    expected = torch_adamw(model, params, x, y, plan)
    solved = local_sgd(model, params, buffers, x, y, plan, LR, adamw=OPT)
    assert_close(solved.params, expected, MATCH)
    assert solved.moments is not None and float(solved.moments["step"]) == STEPS
    # three steps, then three more from the moments: the same six steps
    first = local_sgd(model, params, buffers, x, y, plan[:3], LR, adamw=OPT)
    rest = local_sgd(
        model, first.params, first.buffers, x, y, plan[3:], LR, adamw=OPT, moments=first.moments
    )
    assert_close(rest.params, expected, MATCH)
    # without the moments the second half restarts Adam's bias correction: a different point
    fresh = local_sgd(model, first.params, first.buffers, x, y, plan[3:], LR, adamw=OPT)
    assert max((fresh.params[k] - expected[k]).abs().max() for k in expected) > 1e-4


def test_lean_trainer_adamw_moves_only_the_trainable_keys():
    model, x, y, plan = model_and_data()
    params, buffers = model.initial_state(1)
    head = [k for k in params if k.startswith(list(params)[-1].rsplit(".", 1)[0])]
    expected = torch_adamw(model, params, x, y, plan, keys=head)
    solved = local_sgd(model, params, buffers, x, y, plan, LR, trainable=head, adamw=OPT)
    assert_close(solved.params, expected, MATCH)
    frozen = [k for k in params if k not in head]
    assert frozen and all(torch.equal(solved.params[k], params[k]) for k in frozen)


def gradients(model, params, x, y, plan) -> list[dict[str, torch.Tensor]]:
    """The gradients torch's AdamW sees along ``plan`` (recomputed at its iterates)."""
    module = copy.deepcopy(model.module)
    module.load_state_dict(params, strict=False)
    named = dict(module.named_parameters())
    opt = torch.optim.AdamW(
        named.values(), lr=LR, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    out = []
    for idx in plan:
        opt.zero_grad()
        model.loss_from_output(module(x[idx]), y[idx]).backward()
        out.append({k: p.grad.clone() for k, p in named.items()})
        opt.step()
    return out


@pytest.mark.parametrize("form", ["pure", "vmap", "stacked", "stacked-transposed"])
def test_functional_adamw_step_equals_torch_adamw(form):
    """The client programs' step (pure; vmapped over 3 clients; on a stacked chunk, in place,
    also with gradients laid out transposed, as autograd returns a weight used as W^T in a
    batched product) fed torch's gradients reproduces torch's iterates."""
    model, x, y, plan = model_and_data()
    params, _ = model.initial_state(2)
    expected = torch_adamw(model, params, x, y, plan)
    grads = gradients(model, params, x, y, plan)
    if form == "pure":
        p, m = params, init_moments(params)
        for g in grads:
            p, m = adamw_step(p, g, m, LR, OPT)
        assert_close(p, expected, MATCH)
        return
    c = 3

    def rows(tree):
        return {k: v.expand(c, *v.shape).clone() for k, v in tree.items()}

    p = rows(params)
    moments = init_moments(params)
    m = {"m": rows(moments["m"]), "v": rows(moments["v"]), "step": torch.zeros(c).double()}
    step = vmap(lambda p, g, m: adamw_step(p, g, m, LR, OPT), in_dims=(0, None, 0))
    for g in grads:
        if form == "vmap":
            p, m = step(p, g, m)
        elif form == "stacked":
            adamw_stacked_(p, rows(g), m, LR, OPT)
        else:  # the same values, each matrix's rows and columns swapped in memory
            laid = {k: v.mT.contiguous().mT if v.ndim == 3 else v for k, v in rows(g).items()}
            assert not all(v.is_contiguous() for v in laid.values())
            adamw_stacked_(p, laid, m, LR, OPT)
    for i in range(c):
        assert_close({k: v[i] for k, v in p.items()}, expected, MATCH)


# -- runs: sequential == vectorized, persisted moments, resume --------------------------------

ADAMW = {"kind": "adamw", "weight_decay": 0.05}


def run_config(algorithm: str, executor: dict, **optimizer) -> dict:
    cfg = equivalence_config(algorithm, "mlp", executor, 16)
    cfg["algorithm"].update(HYPER.get(algorithm, {}))
    cfg["train"].update(lr=0.003, optimizer={**ADAMW, **optimizer})
    return cfg


HYPER = {
    "fedprox": {"mu": 0.1},
    "scaffold": {"option": "I"},
    "fedntd": {"beta": 1.0},
    "fedala": {"max_init_epochs": 4, "rand_percent": 40},
}

HEAVY = pytest.mark.heavy(budget=40)

CASES = [
    ("fedavg", "round"),  # the lean trainer against the stacked chunk
    ("local", "client"),  # moments kept in the client's state
    ("scaffold", "client"),  # kept beside a client state the correction reads
    pytest.param("fedprox", "round", marks=HEAVY),  # a gradient correction
    pytest.param("fedntd", "round", marks=HEAVY),  # an objective program (vmapped)
    pytest.param("fedala", "client", marks=HEAVY),  # after a weight-learning phase of its own
    pytest.param("fedas", "round", marks=HEAVY),  # after an alignment phase of its own
]


@pytest.mark.parametrize(("algorithm", "moments"), CASES)
def test_sequential_equals_vectorized_with_adamw(algorithm, moments):
    runs = [
        fedloom.run(run_config(algorithm, ex, moments=moments), write=False, progress=False)
        for ex in ({"kind": "sequential"}, {"kind": "vectorized", "chunk_size": 3})
    ]
    assert_same(*runs)


@HEAVY
def test_adamw_on_dpsgds_private_gradient_sequential_equals_vectorized():
    """Under sample-level DP AdamW steps on DP-SGD's noised gradient (the program's step, on
    both backends: the private update draws the same noise per client on each)."""
    runs = []
    for ex in ({"kind": "sequential"}, {"kind": "vectorized", "chunk_size": 3}):
        cfg = run_config("fedavg", ex)
        cfg["train"].update(stragglers=0.0, rounds=2)
        cfg["privacy"] = {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}
        runs.append(fedloom.run(cfg, write=False, progress=False))
    assert_same(*runs)
    sgd = run_config("fedavg", {"kind": "sequential"})
    sgd["train"].update(stragglers=0.0, rounds=2, optimizer="sgd")
    sgd["privacy"] = {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}
    plain = fedloom.run(sgd, write=False, progress=False)
    assert plain.history[-1]["train_loss"] != runs[0].history[-1]["train_loss"]


def test_kept_moments_change_the_run_and_survive_a_resume(tmp_path):
    cfg = run_config("local", {"kind": "sequential"}, moments="client")
    cfg["train"]["rounds"] = 4
    cfg["checkpoint"] = {"every": 2}
    full, _, _ = killed_and_resumed(cfg, tmp_path, crash_round=3)
    per_round = fedloom.run({**cfg, "train": {**cfg["train"], "optimizer": ADAMW}}, write=False)
    assert full.history[-1]["train_loss"] != per_round.history[-1]["train_loss"]


# -- config -----------------------------------------------------------------------------------


def test_optimizer_config_reads_a_kind_or_a_mapping_and_names_bad_keys():
    assert parse_config({"train": {"optimizer": "adamw"}}).train.optimizer.adamw() == AdamW()
    sgd = parse_config({}).train.optimizer
    assert sgd.adamw() is None and sgd.model_dump() == {"kind": "sgd"}
    bad = [
        ({"kind": "sgd", "weight_decay": 0.1}, "weight_decay applies only to kind: adamw"),
        ({"kind": "adamw", "betas": [0.9, 1.0]}, "train.optimizer.betas"),
        ({"kind": "adamw", "eps": 0}, "train.optimizer.eps"),
        ({"kind": "adam"}, "train.optimizer.kind"),
    ]
    for optimizer, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_config({"train": {"optimizer": optimizer}})


REFUSED = [
    ("fedsgd", {}, "fedsgd uploads the gradient read off one SGD step"),
    ("fednova", {}, "fednova normalizes each client's progress"),
    ("scaffold", {}, "scaffold option II reads the mean gradient"),
    ("perfedavg", {"moments": "client"}, "moments: client: perfedavg keeps no client state"),
    ("fedavg", {"moments": "client"}, "moments: client: fedavg keeps no client state"),
]


@pytest.mark.parametrize(("algorithm", "optimizer", "message"), REFUSED)
def test_adamw_is_refused_where_it_cannot_apply(algorithm, optimizer, message):
    cfg = {
        "data": {"name": "digits", "num_clients": 4},
        "algorithm": {"name": algorithm},
        "train": {"rounds": 1, "optimizer": {**ADAMW, **optimizer}},
    }
    with pytest.raises(ConfigError, match=message):
        fedloom.run(cfg, write=False, progress=False)
