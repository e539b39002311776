"""Each client's dropout masks when a chunk of clients trains at once (docs/executors.md,
"Dropout").

The sequential backend draws a client's masks from torch's global generator seeded with the
stream (seed, 'dropout', round, client) (``FunctionalModel.random_stream``): every dropout
call of its forward passes draws, in order, the noise ``F.dropout`` draws for the client's
real minibatch. A chunk keeps one generator per client on that same stream
(:class:`ChunkDropout`) and, while it runs (:meth:`ChunkDropout.swapped`), every
``nn.Dropout``/``Dropout1d``/``Dropout2d``/``Dropout3d`` of the module multiplies its input by
noise drawn per client from those generators, exactly as ``F.dropout`` draws it on the CPU:
``empty(shape).bernoulli_(1 - p)`` divided by ``1 - p`` (no draw for p = 0, p = 1 or evaluation
mode), of shape (n_c, ...) for a client with n_c real samples, zero-padded to the call's padded
width; a client that does not take the step draws nothing.

Two ways in:

- the stacked path (core/stacked.py) runs the module on one merged batch of C*B rows: the
  swapped forward reshapes it to (C, B, ...) and multiplies by the drawn noise;
- under ``torch.func.vmap`` random operations are refused, so the noise comes from a custom
  operator (``fedloom::client_dropout_noise``) whose vmap rule draws each client's noise from
  its own generator and stacks them. The forward is ``x * noise(x.detach(), p)``:
  differentiable through the product only, as ``F.dropout`` is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fedloom.core.rng import generator

DROPOUT_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
"""The dropout layers a chunk runs with each client's own masks."""

SPATIAL = {nn.Dropout1d: 1, nn.Dropout2d: 2, nn.Dropout3d: 3}
"""Feature dropout: the spatial dimensions after (N, C) that share one mask value."""


def refused_dropout(module: nn.Module) -> list[str]:
    """Names of the dropout layers of ``module`` a chunk cannot run with each client's masks
    (``AlphaDropout``, ``FeatureAlphaDropout`` and any other dropout class)."""
    return [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and type(m) not in DROPOUT_LAYERS
    ]


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` holds any dropout layer."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) for m in module.modules())


def noise_shape(shape: Sequence[int], spatial: int) -> tuple[int, ...]:
    """The shape of the noise ``F.dropout`` (``spatial`` 0) or ``F.dropout{1,2,3}d`` draws for
    an input of ``shape``: the input's own, or (N, C, 1, ...) for feature dropout (a
    ``Dropout2d`` input of three dimensions is (N, C, L), as torch reads it); an unbatched
    feature input (C, ...) draws (C, 1, ...)."""
    shape = tuple(int(d) for d in shape)
    if spatial == 0:
        return shape
    if len(shape) == spatial + 2 or (spatial == 2 and len(shape) == 3):
        return (*shape[:2], *([1] * (len(shape) - 2)))
    return (shape[0], *([1] * (len(shape) - 1)))


def draw_noise(
    gen: torch.Generator, shape: Sequence[int], p: float, dtype: torch.dtype
) -> torch.Tensor:
    """The noise ``F.dropout(x, p, training=True)`` multiplies ``x`` by on the CPU, drawn from
    ``gen`` exactly as torch draws it from the global generator (bit for bit, with the same
    consumption of the stream): Bernoulli(1 - p) over ``1 - p``; zeros without a draw at
    p = 1. A fresh contiguous tensor, so the draws come in the same order as torch's."""
    noise = torch.empty(tuple(shape), dtype=dtype)
    if p >= 1.0:
        return noise.zero_()
    if noise.numel() == 0:
        return noise
    noise.bernoulli_(1.0 - p, generator=gen)
    return noise.div_(1.0 - p)


@dataclass
class Call:
    """Who takes one update call of a chunk: the chunk indices of the call's clients
    (``members``, in the call's order), whether each takes the step (``on``), each plan's
    real minibatch size of each member (``sizes``), the padded width of the call's
    minibatches, and whether the module runs stacked (merged rows) or under ``vmap``."""

    members: list[int]
    on: list[bool]
    sizes: list[list[int]]
    width: int
    stacked: bool = False

    def rows(self, width: int) -> list[int]:
        """Each member's real sample count for a dropout input of ``width`` samples per
        client: its minibatch size where ``width`` is the call's padded width, else all
        ``width`` (an input that is no minibatch draws in full, as on one client)."""
        if width != self.width:
            return [width] * len(self.members)
        distinct = {tuple(s) for s in self.sizes}
        if len(distinct) > 1:
            raise ValueError(
                "dropout on a chunk of clients: the update's plans have different minibatch "
                f"sizes at the same padded width {width}, so which samples are real is "
                "ambiguous; run this model on executor.kind: sequential (docs/executors.md)"
            )
        if not distinct:
            return [width] * len(self.members)
        return [min(n, width) for n in distinct.pop()]


class ChunkDropout:
    """The dropout masks of a chunk of clients: one generator per client on the stream
    (seed, 'dropout', round, client) the sequential backend seeds its global generator with,
    continued across the chunk's steps, and the update call in progress (:meth:`call`)."""

    def __init__(self, seed: int, round: int, clients: Sequence[int]) -> None:
        self.generators = [generator(seed, "dropout", round, c) for c in clients]
        self.current: Call | None = None

    @contextmanager
    def call(self, call: Call) -> Iterator[None]:
        """Inside the block, dropout draws for ``call``'s clients."""
        previous, self.current = self.current, call
        try:
            yield
        finally:
            self.current = previous

    def draw(
        self, per_client: Sequence[int], p: float, spatial: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """(members, *per_client) noise of the current call for a dropout input whose
        per-client shape is ``per_client`` (samples first): each member that takes the step
        draws for its real samples from its own generator, zero-padded; the others draw
        nothing and get zeros (on the CPU)."""
        call = self.current
        if call is None:
            raise RuntimeError("dropout on a chunk of clients outside a chunk's update call")
        shape = noise_shape(per_client, spatial)
        out = torch.zeros((len(call.members), *shape), dtype=dtype)
        # a 0-d input has no samples to pad: drawn whole below
        counts = call.rows(int(per_client[0])) if per_client else [0] * len(call.members)
        for i, (c, on) in enumerate(zip(call.members, call.on, strict=True)):
            if not on:
                continue
            if not per_client:
                out[i] = draw_noise(self.generators[c], shape, p, dtype)
                continue
            n = counts[i]
            if n == 0:
                continue  # an empty minibatch: F.dropout returns at once
            real = noise_shape((n, *per_client[1:]), spatial)
            out[i, :n] = draw_noise(self.generators[c], real, p, dtype)
        return out

    @contextmanager
    def swapped(self, module: nn.Module) -> Iterator[None]:
        """Inside the block every dropout layer of ``module`` (``DROPOUT_LAYERS``) draws its
        masks from this chunk's generators (see the module doc); in evaluation mode, or at
        p = 0, it passes its input through. ``AlphaDropout`` and other classes are refused."""
        refused = refused_dropout(module)
        if refused:
            raise ValueError(
                f"dropout layers {', '.join(refused)} cannot draw each client's masks on a "
                "chunk of clients (docs/executors.md)"
            )
        layers = [m for m in module.modules() if type(m) in DROPOUT_LAYERS]
        for layer in layers:
            layer.forward = _client_forward(self, layer)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward  # back to the class's forward


_ACTIVE: list[ChunkDropout] = []
"""The chunk whose draws the custom operator's vmap rule makes (innermost last)."""


def _client_forward(source: ChunkDropout, layer: nn.Module) -> object:
    p = float(layer.p)  # type: ignore[arg-type]
    spatial = SPATIAL.get(type(layer), 0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not layer.training or p == 0.0:
            return x
        call = source.current
        if call is None:
            raise RuntimeError("dropout on a chunk of clients outside a chunk's update call")
        if call.stacked:
            # merged rows of the call's clients: client c's samples are rows c*n .. (c+1)*n
            clients = len(call.members)
            rows = x.reshape(clients, -1, *x.shape[1:])
            noise = source.draw(rows.shape[1:], p, spatial, x.dtype).to(x.device)
            return (rows * noise).reshape(x.shape)
        _ACTIVE.append(source)
        try:
            noise = client_dropout_noise(x.detach(), p, spatial)
        finally:
            _ACTIVE.pop()
        return x * noise

    return forward


@torch.library.custom_op("fedloom::client_dropout_noise", mutates_args=())
def client_dropout_noise(x: torch.Tensor, p: float, spatial: int) -> torch.Tensor:
    """The dropout noise of one client's input ``x`` (outside ``vmap``: a chunk of one)."""
    source = _ACTIVE[-1]
    return source.draw(tuple(x.shape), p, spatial, x.dtype)[0].to(x.device)


@client_dropout_noise.register_fake
def _(x: torch.Tensor, p: float, spatial: int) -> torch.Tensor:
    return x.new_empty(noise_shape(x.shape, spatial))


@client_dropout_noise.register_vmap
def _(info: object, in_dims: tuple, x: torch.Tensor, p: float, spatial: int) -> tuple:
    source = _ACTIVE[-1]
    dim = in_dims[0]
    clients = int(info.batch_size)  # type: ignore[attr-defined]
    per_client = x.shape if dim is None else x.movedim(dim, 0).shape[1:]
    call = source.current
    if call is None or len(call.members) != clients:
        raise RuntimeError(
            "dropout under vmap: the vmapped call is not over the chunk's update call's clients"
        )
    with _outside_functorch():
        noise = source.draw(tuple(per_client), p, spatial, x.dtype).to(x.device)
    return noise, 0


def _outside_functorch() -> torch._C._ExcludeDispatchKeyGuard:
    """A block in which torch's random operations run as outside ``torch.func`` transforms.

    A vmap rule runs while functorch's dynamic layers are still on the dispatch stack, so a
    ``bernoulli_`` there is refused ("called random operation while in randomness error
    mode") even on a plain tensor. The draws are plain per-client draws on the CPU from each
    client's own generator, so they are made with functorch's keys excluded. Private torch
    API (``torch._C``), kept to this one function."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode)
    keys = keys | torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchDynamicLayerBackMode)
    keys = keys | torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchVmapMode)
    return torch._C._ExcludeDispatchKeyGuard(keys)
