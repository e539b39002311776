"""A chunk's dropout masks (core/client_dropout.py) are, bit for bit, the masks each client's
``F.dropout`` draws from torch's global generator seeded with its stream (seed, 'dropout',
round, client), as the sequential backend draws them: across consecutive calls, for
element-wise and feature dropout, partial minibatches and clients that sit a step out, on the
stacked path (merged rows) and under ``vmap``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fedloom.core.client_dropout import Call, ChunkDropout, noise_shape
from fedloom.core.rng import seed_for
from fedloom.core.stacked import StackedModel, declares_samplewise, stackable
from fedloom.core.stacked_chain import relu_chain
from fedloom.models.base import FedModel

SEED, ROUND, CLIENTS = 11, 3, [4, 7, 9]

# (calls of one update: each member's minibatch size and whether it takes the step)
CALLS = [
    ([5, 3, 0], [True, True, True]),  # partial minibatches, one empty
    ([4, 4, 2], [True, False, True]),  # client 7 sits this step out
    ([5, 5, 5], [True, True, True]),
]
WIDTH = 5

LAYERS = {
    "dropout": (nn.Dropout, F.dropout, (6,)),
    "dropout2d": (nn.Dropout2d, F.dropout2d, (3, 4, 4)),
}


def reference(layer: str, p: float, xs: torch.Tensor) -> list[list[torch.Tensor | None]]:
    """Each client's outputs of ``F.dropout`` on its real rows at every call it takes, its
    global generator seeded with its stream (the sequential backend)."""
    _, fn, _ = LAYERS[layer]
    out: list[list[torch.Tensor | None]] = []
    for c, client in enumerate(CLIENTS):
        torch.manual_seed(seed_for(SEED, "dropout", ROUND, client))
        row = []
        for k, (sizes, on) in enumerate(CALLS):
            row.append(fn(xs[k, c, : sizes[c]], p, True) if on[c] else None)
        out.append(row)
    return out


def check(layer: str, p: float, outputs: list[torch.Tensor], xs: torch.Tensor) -> None:
    expected = reference(layer, p, xs)
    for k, (sizes, on) in enumerate(CALLS):
        for c in range(len(CLIENTS)):
            got = outputs[k][c]
            want = expected[c][k]
            if not on[c]:  # no draw; the call's masked step ignores these rows
                assert want is None
                if p > 0:
                    assert not got.any()
                continue
            n = sizes[c]
            assert torch.equal(got[:n], want), (layer, p, k, c)
            if p > 0:  # padding rows: weight 0, zero noise
                assert torch.equal(got[n:], torch.zeros_like(got[n:]))


def inputs(layer: str) -> torch.Tensor:
    _, _, features = LAYERS[layer]
    torch.manual_seed(0)
    return torch.randn(len(CALLS), len(CLIENTS), WIDTH, *features) + 3.0  # no exact zeros


@pytest.mark.parametrize("path", ["stacked", "vmap"])
@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_each_path_draws_each_clients_masks(layer, p, path):
    """The stacked path (one merged batch) and the vmap rule (a vmapped call over the clients)
    draw each client's masks; at p = 0 or 1 neither draws (as F.dropout)."""
    module = nn.Sequential(LAYERS[layer][0](p))
    xs = inputs(layer)
    source = ChunkDropout(SEED, ROUND, CLIENTS)
    stacked = path == "stacked"
    outputs = []
    with source.swapped(module):
        for k, (sizes, on) in enumerate(CALLS):
            with source.call(Call([0, 1, 2], on, [sizes], WIDTH, stacked=stacked)):
                if stacked:
                    merged = module(xs[k].reshape(-1, *xs.shape[3:]))
                    outputs.append(merged.view(xs[k].shape))
                else:
                    outputs.append(vmap(module)(xs[k]))
    check(layer, p, outputs, xs)
    if p in (0.0, 1.0):
        fresh = ChunkDropout(SEED, ROUND, CLIENTS)
        for used, unused in zip(source.generators, fresh.generators, strict=True):
            assert torch.equal(used.get_state(), unused.get_state())


def test_a_call_over_some_clients_draws_from_theirs():
    """A call over members 2 and 0 (in that order) draws client 9's and client 4's masks."""
    module = nn.Sequential(nn.Dropout(0.5))
    x = torch.ones(2, 4, 6)
    source = ChunkDropout(SEED, ROUND, CLIENTS)
    with source.swapped(module), source.call(Call([2, 0], [True, True], [[4, 4]], 4)):
        got = vmap(module)(x)
    for row, client in zip(got, [9, 4], strict=True):
        torch.manual_seed(seed_for(SEED, "dropout", ROUND, client))
        assert torch.equal(row, F.dropout(torch.ones(4, 6), 0.5, True))


def test_evaluation_mode_passes_through_and_draws_nothing():
    module = nn.Sequential(nn.Dropout(0.5))
    source = ChunkDropout(SEED, ROUND, CLIENTS[:1])
    x = torch.randn(1, 4, 6)
    with source.swapped(module), source.call(Call([0], [True], [[4]], 4)):
        module.eval()
        assert torch.equal(vmap(module)(x), x)
        module.train()
        got = vmap(module)(x)
    torch.manual_seed(seed_for(SEED, "dropout", ROUND, CLIENTS[0]))
    assert torch.equal(got[0], F.dropout(x[0], 0.5, True))
    assert type(module[0]).forward is nn.Dropout.forward and "forward" not in vars(module[0])


def test_vmapped_gradients_equal_each_clients_own():
    """vmap(grad(loss)) through dropout equals each client's gradient on its real rows with
    its seeded global generator (padding rows weighted 0)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}
    torch.manual_seed(1)
    x, y = torch.randn(3, 5, 8), torch.randint(0, 3, (3, 5))
    sizes = [5, 3, 4]
    w = (torch.arange(5)[None] < torch.tensor(sizes)[:, None]).float()

    def loss(p, xb, yb, wb):
        out = functional_call(model, p, (xb,))
        return (F.cross_entropy(out, yb, reduction="none") * wb).sum()

    stacked = {k: v.expand(3, *v.shape).clone() for k, v in params.items()}
    source = ChunkDropout(SEED, ROUND, CLIENTS)
    with source.swapped(model), source.call(Call([0, 1, 2], [True] * 3, [sizes], 5)):
        grads = vmap(grad(loss))(stacked, x, y, w)
    for c, client in enumerate(CLIENTS):
        n = sizes[c]
        torch.manual_seed(seed_for(SEED, "dropout", ROUND, client))
        own = grad(loss)(params, x[c, :n], y[c, :n], w[c, :n])
        for k in own:
            assert torch.allclose(grads[k][c], own[k], atol=1e-6, rtol=0), (client, k)


def test_ambiguous_width_is_refused_and_other_widths_draw_in_full():
    call = Call([0, 1], [True, True], [[3, 5], [5, 2]], 5)
    with pytest.raises(ValueError, match="ambiguous"):
        call.rows(5)
    assert call.rows(7) == [7, 7]
    assert Call([0, 1], [True, True], [[3, 5], [3, 5]], 5).rows(5) == [3, 5]


def test_noise_shapes_are_torchs():
    assert noise_shape((4, 6), 0) == (4, 6)
    assert noise_shape((4, 3, 5, 5), 2) == (4, 3, 1, 1)
    assert noise_shape((4, 3, 5), 1) == (4, 3, 1)
    assert noise_shape((4, 3, 5), 2) == (4, 3, 1)  # torch reads a 3-d Dropout2d input as (N, C, L)


def simple_cnn() -> nn.Sequential:
    """pfl-research's simple_cnn shape (benchmarks/peer_settings.py) on 3x32x32 images."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(14 * 14 * 64, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, 10),
    )


def test_simple_cnn_runs_stacked_with_each_clients_masks():
    model = simple_cnn()
    assert declares_samplewise(model) and stackable(model)
    torch.manual_seed(2)
    clients, width = 2, 3
    params = {
        k: torch.stack([v.detach() * (1 + 0.1 * c) for c in range(clients)])
        for k, v in model.named_parameters()
    }
    x = torch.rand(clients, width, 3, 32, 32)
    stacked = StackedModel(model)
    source = ChunkDropout(SEED, ROUND, CLIENTS[:clients])
    with source.swapped(model), source.call(Call([0, 1], [True, True], [[3, 2]], 3, True)):
        out = stacked.forward(params, x).view(clients, width, 10)
    for c, n in enumerate([3, 2]):
        torch.manual_seed(seed_for(SEED, "dropout", ROUND, CLIENTS[c]))
        own = functional_call(model, {k: v[c] for k, v in params.items()}, (x[c, :n],))
        assert torch.allclose(out[c, :n], own, atol=1e-5, rtol=0)


def test_what_counts_as_samplewise():
    assert declares_samplewise(nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(4, 2))))
    assert not declares_samplewise(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert not declares_samplewise(nn.Sequential(nn.Softmax(dim=0)))
    assert declares_samplewise(nn.Sequential(nn.Softmax(dim=-1)))
    assert not declares_samplewise(nn.Sequential(nn.Flatten(0)))

    class Custom(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x - x.mean(0))

    assert not declares_samplewise(Custom(nn.Linear(4, 2)))
    assert not stackable(nn.Sequential(nn.Linear(4, 4), nn.AlphaDropout(0.1)))


def test_a_declared_relu_chain_with_dropout_is_not_run_by_hand():
    class Chain(FedModel):
        samplewise = True
        relu_chain = ("fc",)

        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.drop(x.flatten(1)))

    assert stackable(Chain())
    assert relu_chain(Chain()) is None
