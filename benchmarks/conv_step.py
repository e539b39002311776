"""One local SGD step of C clients of a convolutional model, several ways, against the
machine's roofline (issue #37, items 2 and 3; benchmarks/README.md, "Convolution steps").

Usage::

    FEDLOOM_DATA=../shared/data FEDLOOM_OFFLINE=1 PYTHONPATH=src \\
        python benchmarks/conv_step.py [--sections steps,convs,compile,profile]
        [--models simple_cnn,cnn4-cifar,cnn4-mnist,cnn-mnist] [--threads 1,2]
        [--clients 10] [--batch 10] [--repeats 7] [--compile-models simple_cnn] [--json OUT]

A step is forward, backward and the in-place SGD update (lr 0.1) of every client on its own
minibatch of ``--batch`` samples, from its own weights. The models have no dropout: pfl's
``simple_cnn`` is built with its two dropout layers removed (``nn.Identity``), so that every
variant (plain PyTorch's global-generator masks included) computes the same thing.

Sections:

- ``steps``: (a) ``plain``: plain PyTorch, the clients one at a time (a module each,
  ``loss.backward()``, ``torch.optim.SGD.step``, ``zero_grad``: pfl-research's loop);
  (b) ``stacked``: fedloom's ``stacked_sgd_step`` (core/stacked.py: linear layers as
  ``baddbmm``, each Conv2d as one grouped convolution of C groups, or as C separate ones
  when it has at most ``SEPARATE_CONV_MAX_IN_CHANNELS`` input channels); ``stacked_grouped``:
  the same with every Conv2d grouped (before issue #37 item 2); ``lean``: fedloom's
  one-client loop ``local_sgd`` (solvers/local.py on core/lean.py's ``LeanModule``, what the
  sequential executor runs), one step a client, its load and copy-out included; and the same
  three at one client (``plain/C1``, ``stacked/C1``, ``lean/C1``). Interleaved repeats;
  the ratio column is the median over repeats of (variant / ``plain``) in the same repeat,
  and ``stacked``'s ratio to ``stacked_grouped`` is printed the same way. Before timing, the
  updated weights and losses of ``stacked`` and ``lean`` are checked against ``plain``'s, and
  ``stacked_grouped``'s weights against ``stacked``'s (max absolute difference printed).
- ``convs``: every Conv2d of each model, C clients x B samples, forward + weight gradient +
  input gradient (not for a first layer, whose input needs none; as in a step):
  ``grouped`` (one conv of C groups, default layout), ``separate`` (C convs of batch B),
  ``grouped_cl`` and ``separate_cl`` (the same on channels_last tensors and weights),
  ``stacked_conv`` (fedloom's grouped convolution with its regrouping copies, from the
  merged batch, as core/stacked.py runs a layer with many input channels) and
  ``stacked_separate`` (core/stacked.py's separate form: C convolutions on views of the
  merged batch joined by one ``cat``, as it runs a layer with few input channels).
- ``compile``: ``torch.compile`` (inductor, needs a C compiler) of (a)'s one-client loss
  (``functional_call``; autograd and the update outside) and of (b)'s whole
  ``stacked_sgd_step``; compile seconds reported separately, timed against their eager
  versions.
- ``profile``: cProfile of ``plain`` and ``lean`` at one client, 5 steps a client (50 images,
  B = 10), the first model: where the time goes; also timed: ``lean_cl``, the same loop on
  a ``LeanModule(channels_last=True)`` (core/lean.py's option, off by default).

Roofline: ``roofline.measure_peaks`` (GEMM and conv2d peaks) at each thread count, and
``roofline.count_flops``; a variant's share of the peak is the step's counted FLOPs at the
peaks (conv FLOPs at the conv peak, Linear FLOPs at the GEMM peak) over its measured time.
Only ratios between variants timed in the same process are meaningful on a loaded machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import peer_settings
import roofline
import round_time
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedloom.core import stacked
from fedloom.core.functional import FunctionalModel
from fedloom.core.lean import LeanModule
from fedloom.core.stacked import _stacked_conv
from fedloom.engine.threads import torch_threads
from fedloom.models.cnn import CNN
from fedloom.models.cnn4 import CNN4
from fedloom.solvers.local import local_sgd
from fedloom.solvers.program import Batch
from fedloom.solvers.stacked_sgd import stacked_sgd_step

LR = 0.1
NUM_CLASSES = 10


def simple_cnn_no_dropout(shape: tuple[int, int, int]) -> nn.Module:
    """pfl's ``simple_cnn`` with its dropout layers replaced by ``nn.Identity``, declared
    sample-wise (core/stacked.py's condition)."""
    model = peer_settings.simple_cnn(shape, NUM_CLASSES)
    for i, m in enumerate(model):
        if isinstance(m, nn.Dropout):
            model[i] = nn.Identity()
    model.samplewise = True  # type: ignore[assignment]
    return model


MODELS: dict[str, tuple[Callable[[tuple[int, int, int]], nn.Module], tuple[int, int, int]]] = {
    "simple_cnn": (simple_cnn_no_dropout, (3, 32, 32)),
    "cnn4-cifar": (lambda s: CNN4(s, NUM_CLASSES), (3, 32, 32)),
    "cnn4-mnist": (lambda s: CNN4(s, NUM_CLASSES), (1, 28, 28)),
    "cnn-mnist": (lambda s: CNN(s, NUM_CLASSES), (1, 28, 28)),
}


@contextmanager
def conv_form(max_in_channels: int) -> Iterator[None]:
    """Inside the block, core/stacked.py runs a convolution with at most ``max_in_channels``
    input channels as C separate convolutions and every other as one grouped convolution
    (0: all grouped, the form before issue #37 item 2)."""
    saved = stacked.SEPARATE_CONV_MAX_IN_CHANNELS
    stacked.SEPARATE_CONV_MAX_IN_CHANNELS = max_in_channels
    try:
        yield
    finally:
        stacked.SEPARATE_CONV_MAX_IN_CHANNELS = saved


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- peaks at a thread count ------------------------------------------------------------------
@contextmanager
def pinned(n: int) -> Iterator[None]:
    """roofline's peaks run under ``round_time.threads(None)`` (all cores); inside this block
    that call pins ``n`` threads instead."""
    original = round_time.threads
    round_time.threads = lambda _n: original(n)  # type: ignore[assignment]
    try:
        yield
    finally:
        round_time.threads = original  # type: ignore[assignment]


def peaks_at(n: int, gemm_size: int = 2048, shapes: Any = roofline.CONV_SHAPES) -> dict[str, Any]:
    with pinned(n):
        peaks = roofline.measure_peaks(gemm_size, shapes)
    peaks["threads"] = n
    return peaks


def share(flops: dict[str, float], seconds: float, peaks: dict[str, Any]) -> float:
    return roofline.roofline_seconds(flops, peaks) / seconds


# -- the clients ------------------------------------------------------------------------------
class Clients:
    """C clients of one model: each its own weights (seed c) and minibatch of B samples, as
    plain modules with their optimizers and as fedloom's stacked parameters."""

    def __init__(self, name: str, clients: int, batch: int, seed: int = 0) -> None:
        make, shape = MODELS[name]
        self.name, self.shape, self.C, self.B = name, shape, clients, batch
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.rand(clients, batch, *shape, generator=gen)
        self.y = torch.randint(0, NUM_CLASSES, (clients, batch), generator=gen)
        self.w = torch.ones(clients, batch)
        self.modules = []
        for c in range(clients):
            torch.manual_seed(seed * 1000 + c)
            self.modules.append(make(shape).train())
        self.template = make(shape)
        self.fm = FunctionalModel(self.template, "classification")  # type: ignore[arg-type]
        self.start = [
            {k: v.detach().clone() for k, v in m.named_parameters()} for m in self.modules
        ]
        self.opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in self.modules]
        self.stacked = self.stack(range(clients))
        self.stacked1 = self.stack(range(1))
        self.plan = [torch.arange(batch)]
        count = roofline.count_flops(self.template, torch.zeros(shape))
        self.flops_per_sample = count.scaled(1.0)

    def stack(self, which: range) -> dict[str, torch.Tensor]:
        return {k: torch.stack([self.start[c][k] for c in which]) for k in self.start[0]}

    def step_flops(self, clients: int) -> dict[str, float]:
        return {k: v * clients * self.B for k, v in self.flops_per_sample.items()}

    # (a) plain PyTorch, one client at a time
    def plain(self, clients: int) -> None:
        for c in range(clients):
            loss = F.cross_entropy(self.modules[c](self.x[c]), self.y[c])
            loss.backward()
            self.opts[c].step()
            self.opts[c].zero_grad(set_to_none=True)

    # (b) fedloom's stacked step
    def stacked_step(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        n = next(iter(params.values())).shape[0]
        return stacked_sgd_step(self.fm, params, Batch(self.x[:n], self.y[:n], self.w[:n]), LR)

    def stacked_grouped_step(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """(b) with every convolution as one grouped convolution (before issue #37 item 2)."""
        with conv_form(0):
            return self.stacked_step(params)

    # fedloom's one-client loop, one step a client
    def lean(self, clients: int) -> list[Any]:
        return [
            local_sgd(self.fm, self.start[c], {}, self.x[c], self.y[c], self.plan, LR)
            for c in range(clients)
        ]

    def check(self) -> dict[str, float]:
        """One step of each from the same weights: max |difference| of the updated weights
        and of the losses, stacked and lean against plain (the modules and the stacked
        weights are then back at the start)."""
        losses = [
            F.cross_entropy(m(self.x[c]), self.y[c]).item() for c, m in enumerate(self.modules)
        ]
        self.plain(self.C)
        plain_after = [dict(m.named_parameters()) for m in self.modules]
        st = self.stack(range(self.C))
        st_losses = self.stacked_step(st)
        st_grouped = self.stack(range(self.C))
        self.stacked_grouped_step(st_grouped)
        sols = self.lean(self.C)
        d_stacked = max(
            (st[k][c] - plain_after[c][k]).abs().max().item() for c in range(self.C) for k in st
        )
        d_lean = max(
            (sols[c].params[k] - plain_after[c][k]).abs().max().item()
            for c in range(self.C)
            for k in st
        )
        d_forms = max((st[k] - st_grouped[k]).abs().max().item() for k in st)
        d_loss = max(abs(a - b) for a, b in zip(losses, st_losses.tolist(), strict=True))
        d_lean_loss = max(abs(a - s.loss) for a, s in zip(losses, sols, strict=True))
        self.reset()
        return {
            "stacked_weights": d_stacked,
            "stacked_loss": d_loss,
            "stacked_forms": d_forms,
            "lean_weights": d_lean,
            "lean_loss": d_lean_loss,
        }

    def reset(self) -> None:
        with torch.no_grad():
            for m, s in zip(self.modules, self.start, strict=True):
                for k, p in m.named_parameters():
                    p.copy_(s[k])
            for k, v in self.stack(range(self.C)).items():
                self.stacked[k].copy_(v)
            for k, v in self.stack(range(1)).items():
                self.stacked1[k].copy_(v)


def interleaved(
    variants: dict[str, Callable[[], Any]], repeats: int, inner: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds per call of each variant, ``repeats`` rounds of ``inner`` calls each, the
    variants alternating within a round."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner)
    return times


def summarize(
    times: dict[str, list[float]], base: str, flops: dict[str, dict[str, float]], peaks: dict
) -> dict[str, Any]:
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = statistics.median(t / b for t, b in zip(ts, times[base], strict=True))
        f = flops[name]
        out[name] = {
            "ms": med * 1e3,
            "ms_all": [t * 1e3 for t in ts],
            "vs_base": ratio,
            "gflops": f["total"] / med / 1e9,
            "flops": f,
            "share_of_peak": share(f, med, peaks),
        }
    return out


# -- section: steps ---------------------------------------------------------------------------
def steps_section(
    models: list[str], threads: list[int], clients: int, batch: int, repeats: int, peaks: dict
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in models:
        cl = Clients(name, clients, batch)
        agree = cl.check()
        log(f"steps {name}: agreement {agree}")
        full, one = cl.step_flops(clients), cl.step_flops(1)
        variants = {
            "plain": lambda cl=cl: cl.plain(cl.C),
            "stacked": lambda cl=cl: cl.stacked_step(cl.stacked),
            "stacked_grouped": lambda cl=cl: cl.stacked_grouped_step(cl.stacked),
            "lean": lambda cl=cl: cl.lean(cl.C),
            "plain/C1": lambda cl=cl: cl.plain(1),
            "stacked/C1": lambda cl=cl: cl.stacked_step(cl.stacked1),
            "lean/C1": lambda cl=cl: cl.lean(1),
        }
        flops = {k: (one if k.endswith("C1") else full) for k in variants}
        results[name] = {"agreement": agree, "threads": {}}
        for n in threads:
            with torch_threads(n):
                times = interleaved(variants, repeats, inner=2)
            cl.reset()
            res = summarize(times, "plain", flops, peaks[n])
            c1 = {k: v for k, v in res.items() if k.endswith("C1")}
            for v in c1.values():  # at one client, against plain at one client
                v["vs_base"] = statistics.median(
                    a / b for a, b in zip(v["ms_all"], res["plain/C1"]["ms_all"], strict=True)
                )
            res["stacked"]["vs_grouped"] = statistics.median(
                a / b
                for a, b in zip(
                    res["stacked"]["ms_all"], res["stacked_grouped"]["ms_all"], strict=True
                )
            )
            results[name]["threads"][n] = res
            log(
                f"steps {name} t{n}: "
                + ", ".join(f"{k} {v['ms']:.2f} ms ({v['vs_base']:.2f}x)" for k, v in res.items())
            )
    return results


# -- section: convs ---------------------------------------------------------------------------
def conv_layers(name: str, batch: int) -> list[tuple[str, nn.Conv2d, tuple[int, ...], bool]]:
    """(name, layer, input shape (B, cin, H, W), first layer?) of each Conv2d of the model."""
    make, shape = MODELS[name]
    model = make(shape)
    found: list[tuple[str, nn.Conv2d, tuple[int, ...], bool]] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(m: nn.Module, inp: tuple[Any, ...], out: Any) -> None:
        if isinstance(m, nn.Conv2d):
            found.append((names[m], m, tuple(inp[0].shape), not inp[0].requires_grad))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    with torch.enable_grad():
        model(torch.zeros(batch, *shape))
    for h in handles:
        h.remove()
    return found


def conv_variants(
    layer: nn.Conv2d, in_shape: tuple[int, ...], first: bool, clients: int
) -> tuple[dict[str, Callable[[], Any]], float]:
    """The six ways to run C clients' forward + gradients of ``layer``; and their FLOPs."""
    b, cin, h, w = in_shape
    cout, k = layer.out_channels, layer.kernel_size
    pad, stride = layer.padding, layer.stride
    gen = torch.Generator().manual_seed(0)
    xs = torch.rand(clients, b, cin, h, w, generator=gen)
    ws = torch.randn(clients, cout, cin, *k, generator=gen) * 0.05
    bs = torch.zeros(clients, cout)
    cl = torch.channels_last

    def make(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor, groups: int, fmt: Any) -> Any:
        x = x.contiguous(memory_format=fmt).requires_grad_(not first)
        wt = wt.contiguous(memory_format=fmt).requires_grad_(True)
        bias = bias.clone().requires_grad_(True)
        with torch.no_grad():
            shape = F.conv2d(x, wt, bias, stride, pad, 1, groups).shape
        seeded = torch.Generator().manual_seed(1)  # the same output gradient in either layout
        gy = torch.randn(shape, generator=seeded).contiguous(memory_format=fmt)
        wanted = [wt, bias] + ([] if first else [x])

        def run() -> Any:
            y = F.conv2d(x, wt, bias, stride, pad, 1, groups)
            return torch.autograd.grad(y, wanted, gy)

        return run

    grouped_x = xs.transpose(0, 1).reshape(b, clients * cin, h, w)
    grouped_w = ws.reshape(clients * cout, cin, *k)
    grouped_b = bs.reshape(-1)

    def separate(fmt: Any) -> Callable[[], None]:
        runs = [make(xs[c], ws[c], bs[c], 1, fmt) for c in range(clients)]

        def run() -> None:
            for r in runs:
                r()

        return run

    merged = xs.reshape(clients * b, cin, h, w).clone().requires_grad_(not first)
    sw, sb = ws.clone().requires_grad_(True), bs.clone().requires_grad_(True)
    with conv_form(0):
        fwd = _stacked_conv(layer, sw, sb, clients)
    with conv_form(10**6):
        fwd_separate = _stacked_conv(layer, sw, sb, clients)
    with torch.no_grad():
        gy_merged = torch.randn_like(fwd(merged))
    wanted_merged = [sw, sb] + ([] if first else [merged])

    def stacked_conv() -> Any:
        return torch.autograd.grad(fwd(merged), wanted_merged, gy_merged)

    def stacked_separate() -> Any:
        return torch.autograd.grad(fwd_separate(merged), wanted_merged, gy_merged)

    variants = {
        "grouped": make(grouped_x, grouped_w, grouped_b, clients, torch.contiguous_format),
        "separate": separate(torch.contiguous_format),
        "grouped_cl": make(grouped_x, grouped_w, grouped_b, clients, cl),
        "separate_cl": separate(cl),
        "stacked_conv": stacked_conv,
        "stacked_separate": stacked_separate,
    }
    with torch.no_grad():
        oh, ow = F.conv2d(xs[0], ws[0], None, stride, pad).shape[2:]
    macs = clients * b * cout * oh * ow * cin * k[0] * k[1]
    flops = 2.0 * macs * (2 if first else 3)
    return variants, flops


def convs_section(
    models: list[str], threads: list[int], clients: int, batch: int, repeats: int, peaks: dict
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in models:
        for lname, layer, in_shape, first in conv_layers(name, batch):
            key = f"{name}.{lname}"
            variants, flops = conv_variants(layer, in_shape, first, clients)
            fl = {v: {"total": flops, "conv": flops, "gemm": 0.0} for v in variants}
            entry: dict[str, Any] = {
                "shape": f"{clients}x{in_shape[0]}x{in_shape[1]}x{in_shape[2]}x{in_shape[3]}"
                f"->{layer.out_channels} k{layer.kernel_size[0]} p{layer.padding[0]}",
                "first": first,
                "threads": {},
            }
            for n in threads:
                with torch_threads(n):
                    times = interleaved(variants, repeats, inner=3)
                res = summarize(times, "grouped", fl, peaks[n])
                entry["threads"][n] = res
                log(
                    f"convs {key} t{n}: "
                    + ", ".join(
                        f"{k} {v['ms']:.2f} ms ({v['vs_base']:.2f}x)" for k, v in res.items()
                    )
                )
            results[key] = entry
    return results


# -- section: compile -------------------------------------------------------------------------
def compile_section(
    models: list[str], threads: list[int], clients: int, batch: int, repeats: int, peaks: dict
) -> dict[str, Any]:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        msg = "torch.compile skipped: no C compiler on PATH (inductor's CPU backend needs cc)"
        log(msg)
        return {"skipped": msg}
    import torch._inductor.config

    torch._inductor.config.force_disable_caches = True  # compile times from scratch
    return {name: compile_model(name, threads, clients, batch, repeats, peaks) for name in models}


def compile_model(
    name: str, threads: list[int], clients: int, batch: int, repeats: int, peaks: dict
) -> dict[str, Any]:
    cl = Clients(name, clients, batch)
    template = cl.template
    keys = list(cl.start[0])
    params = [{k: v.clone().requires_grad_(True) for k, v in s.items()} for s in cl.start]

    def loss_of(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(template, p, (x,)), y)

    def functional_step(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for c in range(cl.C):
                loss = fn(params[c], cl.x[c], cl.y[c])
                grads = torch.autograd.grad(loss, [params[c][k] for k in keys])
                with torch.no_grad():
                    torch._foreach_add_([params[c][k] for k in keys], grads, alpha=-LR)

        return run

    entry: dict[str, Any] = {"compile_s": {}, "errors": {}, "threads": {}}
    for n in threads:  # inductor bakes the thread count into its kernels: compile per count
        torch._dynamo.reset()
        variants: dict[str, Callable[[], Any]] = {
            "plain": lambda cl=cl: cl.plain(cl.C),
            "functional": functional_step(loss_of),
            "stacked": lambda cl=cl: cl.stacked_step(cl.stacked),
        }
        with torch_threads(n):
            try:
                compiled_loss = torch.compile(loss_of, dynamic=False)
                start = time.perf_counter()
                functional_step(compiled_loss)()  # compiles forward and backward
                entry["compile_s"][f"plain_compiled/t{n}"] = time.perf_counter() - start
                variants["plain_compiled"] = functional_step(compiled_loss)
            except Exception as exc:  # a clean fallback: report, keep the eager variants
                entry["errors"][f"plain_compiled/t{n}"] = _first_line(exc)
            try:
                compiled_stacked = torch.compile(cl.stacked_step, dynamic=False)
                start = time.perf_counter()
                fresh = cl.stack(range(cl.C))
                compiled_stacked(fresh)
                entry["compile_s"][f"stacked_compiled/t{n}"] = time.perf_counter() - start
                eager = cl.stack(range(cl.C))
                cl.stacked_step(eager)
                entry["stacked_compiled_max_diff"] = max(
                    (fresh[k] - eager[k]).abs().max().item() for k in eager
                )
                variants["stacked_compiled"] = lambda f=compiled_stacked, cl=cl: f(cl.stacked)
            except Exception as exc:
                entry["errors"][f"stacked_compiled/t{n}"] = _first_line(exc)
            log(f"compile {name} t{n}: {entry['compile_s']} {entry['errors']}")
            flops = {k: cl.step_flops(cl.C) for k in variants}
            times = interleaved(variants, repeats, inner=2)
        res = summarize(times, "plain", flops, peaks[n])
        entry["threads"][n] = res
        log(
            f"compile {name} t{n}: "
            + ", ".join(f"{k} {v['ms']:.2f} ms ({v['vs_base']:.2f}x)" for k, v in res.items())
        )
    return entry


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


# -- section: profile -------------------------------------------------------------------------
def profile_section(name: str, threads: list[int], batch: int, clients: int = 20) -> dict:
    """cProfile of ``clients`` clients x 5 steps (50 images, B = ``batch``): pfl's loop
    (load_state_dict, new SGD, steps) against fedloom's ``local_sgd``."""
    make, shape = MODELS[name]
    cl = Clients(name, 1, batch)
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(5 * batch, *shape, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (5 * batch,), generator=gen)
    plan = list(torch.arange(5 * batch).split(batch))
    module = make(shape).train()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    params = dict(cl.start[0])

    def plain() -> None:
        for _ in range(clients):
            module.load_state_dict(start)
            opt = torch.optim.SGD(module.parameters(), lr=LR)
            for i in range(0, len(x), batch):
                loss = F.cross_entropy(module(x[i : i + batch]), y[i : i + batch])
                loss.backward()
                opt.step()
                opt.zero_grad()
            {k: v.detach() - start[k] for k, v in module.state_dict().items()}

    def lean() -> None:
        for _ in range(clients):
            local_sgd(cl.fm, params, {}, x, y, plan, LR)

    # the same loop on a LeanModule with channels-last convolution weights (core/lean.py's
    # option, off by default), whose convolutions then give channels-last activations
    fm_cl = FunctionalModel(make(shape), "classification")  # type: ignore[arg-type]
    fm_cl._lean = LeanModule(fm_cl.module, channels_last=True)

    def lean_cl() -> None:
        for _ in range(clients):
            local_sgd(fm_cl, params, {}, x, y, plan, LR)

    check = local_sgd(fm_cl, params, {}, x, y, plan, LR).params
    want = local_sgd(cl.fm, params, {}, x, y, plan, LR).params
    cl_diff = max((check[k] - want[k]).abs().max().item() for k in want)
    out: dict[str, Any] = {}
    for n in threads:
        with torch_threads(n):
            contenders = {"plain": plain, "lean": lean, "lean_cl": lean_cl}
            times = interleaved(contenders, repeats=5, inner=1, warmup=1)
            entry: dict[str, Any] = {
                "ms_per_client": {
                    k: statistics.median(v) / clients * 1e3 for k, v in times.items()
                },
                "lean_vs_plain": statistics.median(
                    a / b for a, b in zip(times["lean"], times["plain"], strict=True)
                ),
                "lean_cl_vs_plain": statistics.median(
                    a / b for a, b in zip(times["lean_cl"], times["plain"], strict=True)
                ),
                "lean_cl_max_diff": cl_diff,
            }
            for label, fn in (("plain", plain), ("lean", lean)):
                prof = cProfile.Profile()
                prof.enable()
                fn()
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
                entry[f"profile_{label}"] = buf.getvalue()
        out[n] = entry
        log(
            f"profile {name} t{n}: {entry['ms_per_client']} lean/plain {entry['lean_vs_plain']:.3f}"
        )
    return out


# -- output -----------------------------------------------------------------------------------
def pct(x: float) -> str:
    return f"{x:.1%}"


def format_tables(results: dict[str, Any]) -> str:
    lines = []
    peaks = results["peaks"]
    lines.append("| threads | GEMM peak GFLOP/s | conv peak GFLOP/s |")
    lines.append("|---|---|---|")
    for n, p in peaks.items():
        lines.append(f"| {n} | {p['gemm_gflops']:.1f} | {p['conv_gflops']:.1f} |")
    if "steps" in results:
        lines += ["", "One step of C clients (ms per step; x: against plain at the same C):", ""]
        lines.append("| model | threads | variant | ms | x plain | GFLOP/s | peak share |")
        lines.append("|---|---|---|---|---|---|---|")
        for name, entry in results["steps"].items():
            for n, res in entry["threads"].items():
                for v, e in res.items():
                    lines.append(
                        f"| {name} | {n} | {v} | {e['ms']:.2f} | {e['vs_base']:.2f} | "
                        f"{e['gflops']:.1f} | {pct(e['share_of_peak'])} |"
                    )
        lines += ["", "stacked against stacked_grouped (median ratio in the same repeat):", ""]
        for name, entry in results["steps"].items():
            for n, res in entry["threads"].items():
                lines.append(f"- {name}, {n} threads: {res['stacked']['vs_grouped']:.3f}x")
        lines += ["", "Agreement with plain after one step (max abs difference):", ""]
        for name, entry in results["steps"].items():
            a = entry["agreement"]
            lines.append(
                f"- {name}: stacked weights {a['stacked_weights']:.1e}, losses "
                f"{a['stacked_loss']:.1e}, stacked_grouped against stacked "
                f"{a['stacked_forms']:.1e}; lean weights {a['lean_weights']:.1e}, losses "
                f"{a['lean_loss']:.1e}"
            )
    if "convs" in results:
        lines += ["", "Convolution layers, forward + gradients (ms; x: against grouped):", ""]
        lines.append(
            "| layer | shape | threads | variant | ms | x grouped | GFLOP/s | peak share |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for key, entry in results["convs"].items():
            for n, res in entry["threads"].items():
                for v, e in res.items():
                    lines.append(
                        f"| {key} | {entry['shape']} | {n} | {v} | {e['ms']:.2f} | "
                        f"{e['vs_base']:.2f} | {e['gflops']:.1f} | {pct(e['share_of_peak'])} |"
                    )
    if "compile" in results:
        comp = results["compile"]
        if "skipped" in comp:
            lines += ["", comp["skipped"]]
        else:
            lines += ["", "torch.compile (ms per C-client step; x: against plain):", ""]
            lines.append("| model | threads | variant | ms | x plain | GFLOP/s | peak share |")
            lines.append("|---|---|---|---|---|---|---|")
            for name, entry in comp.items():
                for n, res in entry["threads"].items():
                    for v, e in res.items():
                        lines.append(
                            f"| {name} | {n} | {v} | {e['ms']:.2f} | {e['vs_base']:.2f} | "
                            f"{e['gflops']:.1f} | {pct(e['share_of_peak'])} |"
                        )
                for v, s in entry["compile_s"].items():
                    lines.append(f"\n{name}: {v} compile time {s:.1f} s")
                for v, err in entry["errors"].items():
                    lines.append(f"\n{name}: {v} not compiled, eager kept: {err}")
    if "profile" in results:
        for n, entry in results["profile"]["threads"].items():
            ms = entry["ms_per_client"]
            lines.append(
                f"\nOne client, 5 steps ({results['profile']['model']}, {n} threads): plain "
                f"{ms['plain']:.2f} ms, lean {ms['lean']:.2f} ms, lean/plain "
                f"{entry['lean_vs_plain']:.3f}; lean with channels-last weights "
                f"{ms['lean_cl']:.2f} ms, x plain {entry['lean_cl_vs_plain']:.3f} (weights within "
                f"{entry['lean_cl_max_diff']:.1e} of lean's)"
            )
            for label in ("plain", "lean"):
                text = entry[f"profile_{label}"]
                body = text[text.find("ncalls") :] if "ncalls" in text else text
                lines.append(f"\ncProfile {label} ({n} threads), top by tottime:\n```\n{body}```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="steps,convs")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compile-models", default="simple_cnn")
    parser.add_argument("--gemm-size", type=int, default=2048)
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    threads = [int(t) for t in args.threads.split(",")]
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: unknown {m!r}; allowed: {', '.join(MODELS)}")
    torch.manual_seed(0)
    peaks = {n: peaks_at(n, args.gemm_size) for n in threads}
    log("peaks: " + str({n: (p["gemm_gflops"], p["conv_gflops"]) for n, p in peaks.items()}))
    results: dict[str, Any] = {
        "clients": args.clients,
        "batch": args.batch,
        "repeats": args.repeats,
        "load_average_start": os.getloadavg(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch": torch.__version__,
    }
    common = (threads, args.clients, args.batch, args.repeats, peaks)
    if "steps" in sections:
        results["steps"] = steps_section(models, *common)
    if "convs" in sections:
        results["convs"] = convs_section(models, *common)
    if "compile" in sections:
        cmodels = [m.strip() for m in args.compile_models.split(",") if m.strip()]
        results["compile"] = compile_section(cmodels, *common)
    if "profile" in sections:
        results["profile"] = {
            "model": models[0],
            "threads": profile_section(models[0], threads, args.batch),
        }
    after = {n: peaks_at(n, args.gemm_size) for n in threads}
    results["peaks"] = {n: roofline.merge_peaks(peaks[n], after[n]) for n in threads}
    results["load_average_end"] = os.getloadavg()
    reshare(results)
    print(format_tables(results))
    print(
        f"\nload average: start {results['load_average_start']}, end {results['load_average_end']}"
    )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0


def reshare(results: dict[str, Any]) -> None:
    """Every variant's share of the peak against the higher of the peaks measured before and
    after the sections (background load only lowers a peak)."""
    peaks = results["peaks"]

    def fix(by_threads: dict[int, dict[str, Any]]) -> None:
        for n, res in by_threads.items():
            for e in res.values():
                e["share_of_peak"] = share(e["flops"], e["ms"] / 1e3, peaks[n])

    for section in ("steps", "convs", "compile"):
        for entry in results.get(section, {}).values():
            if isinstance(entry, dict) and "threads" in entry:
                fix(entry["threads"])


if __name__ == "__main__":
    sys.exit(main())
