"""Seconds per round against the machine's roofline (issue #37, item 5).

Measures the float32 GEMM rate (``round_time.matmul_peak``) and the float32 convolution rate
(conv2d forward, weight and input gradients at CIFAR-like shapes), counts a round's FLOPs from
the model with forward hooks, and times each workload with each executor: seconds per round
(median of ``--rounds`` rounds after one warm-up round) and the share of the peak (the round's
FLOPs at the GEMM and convolution rates, over the measured seconds).

Usage::

    FEDLOOM_DATA=../shared/data FEDLOOM_OFFLINE=1 PYTHONPATH=src \\
        python benchmarks/roofline.py [--workloads W1,W3,pfl_cifar10,fedavg_2nn]
        [--executors auto,sequential,vectorized,processes,sequential/t1] [--rounds 3]
        [--quick] [--json OUT] [--omp-spin]

Workloads: round_time.py's (``W1``, ``W2``, ``W3``, ``pfl``, ``W3-ditto``, ...; every client
each round) and peer_settings.py's ``pfl_cifar10`` and ``fedavg_2nn``. See
benchmarks/README.md, "roofline.py".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import openmp_policy  # first: OpenMP's wait policy, before torch loads
import peer_settings
import round_time
import torch
from torch import nn
from torch.nn import functional as F

from fedloom.config import parse_config
from fedloom.data.federated import FederatedData, from_arrays
from fedloom.engine.loop import Engine, setup_frozen
from fedloom.engine.state import RunState
from fedloom.engine.threads import run_threads

EXECUTORS = ("auto", "sequential", "vectorized", "processes", "vectorized-processes")
"""``executor.kind`` values, and ``processes`` / ``vectorized-processes``: the sequential /
vectorized executor with one worker process per core. A ``/tN`` suffix (``sequential/t1``)
pins N intra-op threads; without it, the count ``Engine.run`` would use (``threads: null``:
engine/threads.py, ``run_threads``)."""
DEFAULT_WORKLOADS = "W1,W2,W3,pfl_cifar10,fedavg_2nn"
QUICK_CLIENTS = 10
CONV_SHAPES = (
    # (batch, in channels, height/width, out channels): simple_cnn's second convolution at
    # its batch size 10 and at 50, and a padded 64 -> 64 layer at 16x16
    (10, 32, 30, 64),
    (50, 32, 30, 64),
    (10, 64, 16, 64),
)


# -- FLOPs --------------------------------------------------------------------------------------
WEIGHT_PASSES = 4
"""Passes over a layer's weights a client step at least: the forward reads them, the input
gradient reads them (not for a first layer), and the SGD update reads and writes them (the
stacked path's ``baddbmm_``; a trainer that forms the gradient first moves more)."""


@dataclass(frozen=True)
class LayerCost:
    """One Conv or Linear layer: ``kind`` (``conv`` or ``gemm``), FLOPs a sample (forward and
    gradients) and weight bytes moved a client step (WEIGHT_PASSES, one fewer for a first
    layer)."""

    kind: str
    flops: float
    weight_bytes: float


@dataclass
class FlopCount:
    """FLOPs of one sample through the Conv and Linear layers (2 per multiply-accumulate):
    forward, weight gradient, input gradient (none for a layer whose input needs no gradient,
    the first layer); ``conv`` and ``gemm`` split the total by layer kind."""

    forward: float = 0.0
    weight_grad: float = 0.0
    input_grad: float = 0.0
    conv: float = 0.0
    gemm: float = 0.0
    layers: list[str] = field(default_factory=list)
    costs: list[LayerCost] = field(default_factory=list)
    """Each layer's FLOPs a sample and weight bytes a client step, for the memory roof."""

    @property
    def total(self) -> float:
        return self.forward + self.weight_grad + self.input_grad

    def scaled(self, n: float) -> dict[str, float]:
        return {
            "forward": self.forward * n,
            "weight_grad": self.weight_grad * n,
            "input_grad": self.input_grad * n,
            "conv": self.conv * n,
            "gemm": self.gemm * n,
            "total": self.total * n,
        }


NOT_COUNTED = (
    "bias additions and bias gradients, activations, pooling, dropout, normalization, the "
    "loss and softmax, the optimizer step and the server's aggregation; matrix products "
    "outside nn.Linear / nn.Conv (torch.matmul in a forward, attention, RNNs)"
)


def count_flops(module: nn.Module, sample: torch.Tensor) -> FlopCount:
    """One sample's (no batch dimension) FLOPs in ``module``'s Conv and Linear layers, by a
    forward pass with hooks; see NOT_COUNTED. The module runs in eval mode (no randomness)
    and gets its mode back."""
    count = FlopCount()

    def hook(m: nn.Module, inp: tuple[Any, ...], out: Any) -> None:
        if isinstance(m, nn.Linear):
            kind, macs = "gemm", out.numel() * m.in_features
        elif isinstance(m, nn.modules.conv._ConvNd):
            kind = "conv"
            macs = out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)
        else:
            return
        flops = 2.0 * macs
        needs_input_grad = bool(inp) and isinstance(inp[0], torch.Tensor) and inp[0].requires_grad
        grads = flops * (1 + int(needs_input_grad))
        count.forward += flops
        count.weight_grad += flops
        count.input_grad += flops if needs_input_grad else 0.0
        setattr(count, kind, getattr(count, kind) + flops + grads)
        count.layers.append(f"{type(m).__name__}:{int(macs)}{'' if needs_input_grad else '*'}")
        weights = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        passes = WEIGHT_PASSES - (0 if needs_input_grad else 1)
        count.costs.append(LayerCost(kind, flops + grads, float(passes * weights)))

    training = module.training
    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        module.eval()
        with torch.enable_grad():
            module(sample.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
        module.train(training)
    return count


# -- peaks ---------------------------------------------------------------------------------------
def conv_rate(batch: int, cin: int, size: int, cout: int, repeats: int = 7) -> float:
    """Float32 conv2d 3x3 (padding 1 when ``size`` < 30, else none) forward + weight and
    input gradients, FLOP/s of the fastest of ``repeats``, on all cores."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cin, size, size, generator=gen, requires_grad=True)
    w = torch.randn(cout, cin, 3, 3, generator=gen, requires_grad=True)
    pad = 1 if size < 30 else 0
    out_hw = size + 2 * pad - 2
    macs = batch * cout * out_hw * out_hw * cin * 9
    times = []
    with round_time.threads(None):
        for i in range(repeats + 1):
            start = time.perf_counter()
            y = F.conv2d(x, w, padding=pad)
            gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
            elapsed = time.perf_counter() - start
            if i:  # the first call is a warm-up
                times.append(elapsed)
            del y, gx, gw
    return 3 * 2.0 * macs / min(times)


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second a float32 tensor of ``megabytes`` is copied at (read plus write), the
    fastest of ``repeats``, on all cores: the memory roof's bandwidth."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    with round_time.threads(None):
        for i in range(repeats + 1):
            start = time.perf_counter()
            dst.copy_(src)
            if i:  # the first call is a warm-up (and faults the pages in)
                times.append(time.perf_counter() - start)
    return 2.0 * src.numel() * 4 / min(times)


def measure_peaks(
    gemm_size: int = 2048,
    shapes: tuple[tuple[int, ...], ...] = CONV_SHAPES,
    copy_megabytes: int = 256,
) -> dict[str, Any]:
    """The GEMM peak (``round_time.matmul_peak``) and the convolution peak (the fastest of
    ``shapes``), FLOP/s, and the copy bandwidth, at the run's thread count (all cores)."""
    gemm = round_time.matmul_peak(gemm_size)
    by_shape = {"x".join(map(str, s)): conv_rate(*s) for s in shapes}
    return {
        "threads": os.cpu_count() or 1,
        "gemm_gflops": gemm / 1e9,
        "conv_gflops": max(by_shape.values()) / 1e9,
        "conv_by_shape_gflops": {k: v / 1e9 for k, v in by_shape.items()},
        "gemm_size": gemm_size,
        "bandwidth_gbs": copy_bandwidth(copy_megabytes) / 1e9,
    }


def merge_peaks(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The higher of two measurements (background load only lowers a peak)."""
    out = dict(a)
    out["gemm_gflops"] = max(a["gemm_gflops"], b["gemm_gflops"])
    out["conv_gflops"] = max(a["conv_gflops"], b["conv_gflops"])
    out["bandwidth_gbs"] = max(a["bandwidth_gbs"], b["bandwidth_gbs"])
    out["conv_by_shape_gflops"] = {
        k: max(v, b["conv_by_shape_gflops"].get(k, 0.0))
        for k, v in a["conv_by_shape_gflops"].items()
    }
    return out


def roofline_seconds(flops: dict[str, float], peaks: dict[str, Any]) -> float:
    """Seconds of the round's counted FLOPs at the peaks: Conv layers at the convolution
    rate, Linear layers at the GEMM rate."""
    return flops["conv"] / (peaks["conv_gflops"] * 1e9) + flops["gemm"] / (
        peaks["gemm_gflops"] * 1e9
    )


def memory_roofline_seconds(
    costs: list[LayerCost], samples: float, client_steps: float, peaks: dict[str, Any]
) -> float:
    """Seconds of a round at the memory-aware roofline: each layer takes the longer of its
    FLOPs at its peak and its weight traffic (``client_steps`` local steps of all clients)
    at the copy bandwidth. A layer that reads a large weight for a few rows a step (the
    12544 -> 128 layer of ``simple_cnn`` at B = 10) is bound by the second."""
    rate = {"conv": peaks["conv_gflops"] * 1e9, "gemm": peaks["gemm_gflops"] * 1e9}
    bandwidth = peaks["bandwidth_gbs"] * 1e9
    return sum(
        max(c.flops * samples / rate[c.kind], c.weight_bytes * client_steps / bandwidth)
        for c in costs
    )


# -- workloads -----------------------------------------------------------------------------------
@dataclass
class Bench:
    """One workload ready to run: its data, a model factory, FedAvg's (or the PFL
    algorithm's) config pieces and the round's sample count."""

    name: str
    fed: FederatedData
    make_model: Any
    sample: torch.Tensor
    algorithm: dict[str, Any]
    per_round: int
    batch_size: int
    lr: float
    epochs: int
    round_samples: float
    """Samples through forward+backward a round (x gradient passes for PFL algorithms)."""
    note: str = ""


def round_time_bench(wl: round_time.Workload, quick: bool) -> Bench:
    """round_time.py's workload ``wl`` (every client each round; ``quick``: 10 clients)."""
    note = ""
    if quick and wl.clients > QUICK_CLIENTS:
        wl = replace(wl, clients=QUICK_CLIENTS)
        note = f"REDUCED: {QUICK_CLIENTS} clients"
    data = round_time.make_data(wl)
    return Bench(
        wl.name,
        data.fed,
        lambda: round_time.make_module(wl),
        torch.zeros(round_time.INPUT_SHAPE),
        dict(wl.algorithm),
        wl.clients,
        wl.batch_size,
        wl.lr,
        wl.epochs,
        wl.clients * wl.samples * wl.epochs * wl.grad_passes,
        note,
    )


def peer_bench(setting: peer_settings.PeerSetting, quick: bool) -> Bench:
    """peer_settings.py's ``setting`` (``quick``: 100 clients, 10 a round)."""
    note = ""
    if quick and setting.per_round > QUICK_CLIENTS:
        setting = peer_settings.shrink(setting, 100, setting.samples, QUICK_CLIENTS)
        note = f"REDUCED: {setting.per_round} of {setting.clients} clients a round"
    train, test, source = peer_settings.make_arrays(setting)
    fed = from_arrays(train=train, test=test, name=f"{source}-{setting.name}")
    return Bench(
        setting.name,
        fed,
        setting.model,
        torch.zeros(setting.input_shape),
        {"name": "fedavg"},
        setting.per_round,
        setting.batch_size,
        setting.lr,
        setting.epochs,
        float(setting.round_samples()),
        "; ".join(x for x in (f"data: {source}", note) if x),
    )


def select(spec: str, quick: bool) -> list[Bench]:
    """Benches named in ``spec``, in order (round_time.py's names and groups, and
    peer_settings.SETTINGS)."""
    peers = {n.lower(): s for n, s in peer_settings.SETTINGS.items()}
    out: list[Bench] = []
    for raw in (r.strip() for r in spec.split(",")):
        if raw.lower() in peers:
            out.append(peer_bench(peers[raw.lower()], quick))
        elif raw:
            out += [round_time_bench(wl, quick) for wl in round_time.select_workloads(raw)]
    return out


def parse_executor(spec: str) -> tuple[dict[str, Any], int | None]:
    """``auto``, ``sequential``, ``vectorized``, ``processes``, ``vectorized-processes`` with
    an optional ``/tN``: the executor section and the thread count to run it under (None: all
    cores)."""
    kind, _, suffix = spec.partition("/")
    n = int(suffix[1:]) if suffix.startswith("t") else None
    if kind in ("processes", "vectorized-processes"):
        inner = "sequential" if kind == "processes" else "vectorized"
        section: dict[str, Any] = {"kind": inner, "workers": os.cpu_count() or 1}
    elif kind in ("auto", "sequential", "vectorized"):
        section = {"kind": kind}
    else:
        raise ValueError(f"--executors: unknown executor {spec!r}; allowed: {', '.join(EXECUTORS)}")
    section["threads"] = n
    return section, n


class Runner:
    """fedloom's Engine on one bench with one executor; times ``Engine.train_round``
    (sampling, plans, client work, aggregation; no evaluation), as round_time.py does."""

    def __init__(self, bench: Bench, spec: str) -> None:
        section, self.threads = parse_executor(spec)
        self.spec = spec
        cfg = parse_config(
            peer_settings.timed_round_config(
                bench.per_round, bench.epochs, bench.batch_size, bench.lr, section, bench.algorithm
            )
        )
        self.engine = Engine(cfg, bench.fed, bench.make_model())
        if self.threads is None:  # what Engine.run runs under (engine/threads.py)
            biggest = max(bench.fed.clients, key=lambda c: c.x_train.shape[0])
            module = self.engine.model.module
            self.threads = run_threads(cfg.executor, module, biggest.x_train[0], bench.batch_size)
        with round_time.threads(self.threads):
            self.engine.executor.prepare(dict(enumerate(bench.fed.clients)))
        self.st = self.engine.initial_state()
        self.times: list[float] = []
        self.rounds = 0

    def warmup(self) -> float:
        """One untimed round on a throwaway copy of the state (auto decides here)."""
        with round_time.threads(self.threads):
            start = time.perf_counter()
            self.engine.train_round(0, RunState(self.st.server, self.engine.new_store()))
            return time.perf_counter() - start

    def round(self) -> float:
        self.rounds += 1
        with round_time.threads(self.threads):
            start = time.perf_counter()
            self.engine.train_round(self.rounds, self.st)
            elapsed = time.perf_counter() - start
        self.times.append(elapsed)
        return elapsed

    def choice(self) -> str:
        executor = self.engine.executor
        choice = getattr(executor, "choice", None)
        return str(choice) if choice else self.spec

    def close(self) -> None:
        close = getattr(self.engine.executor, "close", None)
        if callable(close):
            close()


def measure(
    bench: Bench, executors: list[str], rounds: int, peaks: dict[str, Any]
) -> dict[str, Any]:
    """Every executor on ``bench``: built and warmed up, then ``rounds`` rounds interleaved
    (round r of every executor before round r+1 of any, so background load hits all alike)."""
    model = bench.make_model()
    per_sample = count_flops(model, bench.sample)
    flops = per_sample.scaled(bench.round_samples)
    entry: dict[str, Any] = {
        "note": bench.note,
        "round_gflop": flops["total"] / 1e9,
        "flops": {k: v / 1e9 for k, v in flops.items()},
        "layers": per_sample.layers,
        "layer_costs": [[c.kind, c.flops, c.weight_bytes] for c in per_sample.costs],
        "round_samples": bench.round_samples,
        "client_steps": bench.round_samples / bench.batch_size,
        "executors": {},
    }
    runners: dict[str, Runner] = {}
    for spec in executors:
        try:
            runner = Runner(bench, spec)
            warm = runner.warmup()
        except Exception as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            entry["executors"][spec] = {"refused": message}
            round_time.log(f"{bench.name} {spec}: refused: {message}")
            continue
        runners[spec] = runner
        entry["executors"][spec] = {"warmup_s": warm}
        round_time.log(f"{bench.name} {spec}: warm-up {warm:.3f} s ({runner.choice()})")
    with setup_frozen():
        for r in range(rounds):
            for spec, runner in runners.items():
                t = runner.round()
                round_time.log(f"{bench.name} {spec}: round {r + 1} {t:.3f} s")
    for spec, runner in runners.items():
        median = statistics.median(runner.times)
        entry["executors"][spec].update(
            {
                "s_per_round": median,
                "rounds_s": runner.times,
                "choice": runner.choice(),
                "threads": runner.threads or os.cpu_count() or 1,
                "achieved_gflops": flops["total"] / median / 1e9,
            }
        )
        runner.close()
    set_shares(entry, peaks)
    return entry


def set_shares(entry: dict[str, Any], peaks: dict[str, Any]) -> None:
    """Each executor's share of the compute roofline (``share_of_peak``) and of the
    memory-aware one (``share_of_memory_roof``), at ``peaks``."""
    flops = {k: v * 1e9 for k, v in entry["flops"].items()}
    floor = roofline_seconds(flops, peaks)
    costs = [LayerCost(*c) for c in entry["layer_costs"]]
    memory_floor = memory_roofline_seconds(
        costs, entry["round_samples"], entry["client_steps"], peaks
    )
    for e in entry["executors"].values():
        if "s_per_round" in e:
            e["roofline_s"] = floor
            e["share_of_peak"] = floor / e["s_per_round"]
            e["memory_roofline_s"] = memory_floor
            e["share_of_memory_roof"] = memory_floor / e["s_per_round"]


def format_table(results: dict[str, Any]) -> str:
    peaks = results["peaks"]
    lines = [
        f"OpenMP wait: {results['openmp_wait']} (--omp-spin: libgomp's default spinning)",
        f"peaks ({peaks['threads']} threads): GEMM {peaks['gemm_gflops']:.1f} GFLOP/s "
        f"(float32 {peaks['gemm_size']}^2 torch.mm), conv {peaks['conv_gflops']:.1f} GFLOP/s "
        "(float32 conv2d 3x3 forward + weight and input gradients; by shape "
        + ", ".join(f"{k}: {v:.1f}" for k, v in peaks["conv_by_shape_gflops"].items())
        + ")",
        f"copy bandwidth {peaks['bandwidth_gbs']:.1f} GB/s (read + write); mem roof: each layer "
        f"at the longer of its FLOPs at the peak and {WEIGHT_PASSES} passes over its weights a "
        "client step",
        f"{'workload':<14}{'executor':<16}{'s/round':>10}{'GFLOP':>9}{'GFLOP/s':>9}"
        f"{'roof s':>9}{'peak':>8}{'mem roof s':>11}{'share':>7}  picked / note",
        "-" * 114,
    ]
    for name, entry in results["workloads"].items():
        for spec, e in entry["executors"].items():
            if "refused" in e:
                lines.append(f"{name:<14}{spec:<16}{'refused':>10}{'':>36}  {e['refused'][:70]}")
                continue
            lines.append(
                f"{name:<14}{spec:<16}{e['s_per_round']:>10.4f}{entry['round_gflop']:>9.3g}"
                f"{e['achieved_gflops']:>9.1f}{e['roofline_s']:>9.4f}{e['share_of_peak']:>8.1%}"
                f"{e['memory_roofline_s']:>11.4f}{e['share_of_memory_roof']:>7.1%}"
                f"  {e['choice'] if e['choice'] != spec else ''}"
            )
        if entry["note"]:
            lines.append(f"{'':<14}{entry['note']}")
    lines.append(f"not counted in GFLOP: {NOT_COUNTED}")
    return "\n".join(lines)


def run(
    benches: list[Bench],
    executors: list[str],
    rounds: int,
    gemm_size: int = 2048,
    conv_shapes: tuple[tuple[int, ...], ...] = CONV_SHAPES,
) -> dict[str, Any]:
    """Peaks before and after (the higher counts), then every bench."""
    peaks = measure_peaks(gemm_size, conv_shapes)
    round_time.log(
        f"peaks: GEMM {peaks['gemm_gflops']:.1f}, conv {peaks['conv_gflops']:.1f} GFLOP/s"
    )
    workloads = {b.name: measure(b, executors, rounds, peaks) for b in benches}
    after = measure_peaks(gemm_size, conv_shapes)
    best = merge_peaks(peaks, after)
    for b in benches:  # shares against the higher peaks
        set_shares(workloads[b.name], best)
    return {
        "peaks": best,
        "workloads": workloads,
        "rounds": rounds,
        "load_average": os.getloadavg(),
        "openmp_wait": openmp_policy.POLICY,
        "not_counted": NOT_COUNTED,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    parser.add_argument("--executors", default=",".join(EXECUTORS))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (median)")
    parser.add_argument(
        "--quick", action="store_true", help=f"at most {QUICK_CLIENTS} clients a round"
    )
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")
    parser.add_argument(
        openmp_policy.SPIN_FLAG,
        action="store_true",
        help="libgomp's default spinning instead of fedloom's OMP_WAIT_POLICY=PASSIVE "
        "(read before torch loads: benchmarks/openmp_policy.py)",
    )
    args = parser.parse_args(argv)
    executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    for spec in executors:
        parse_executor(spec)
    benches = select(args.workloads, args.quick)
    results = run(benches, executors, max(1, args.rounds))
    print(format_table(results))
    text = json.dumps(results, indent=1)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(text + "\n")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
