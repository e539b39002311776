"""Where the sequential executor's time goes on pfl-research's ``simple_cnn`` (issue #37,
item 3), against a plain PyTorch loop written the way pfl's ``PyTorchModel`` writes it.

Usage::

    PYTHONPATH=src python benchmarks/sequential_profile.py [--clients 5] [--repeats 5]
        [--threads N] [--profile]

Every contender trains the same ``--clients`` clients of the ``pfl_cifar10`` setting (50
images 3x32x32, batch 10, 1 epoch, lr 0.1: 5 steps a client) from the same weights, in one
process, interleaved, at one thread count (default: what ``Engine.run`` picks,
engine/threads.py). Seconds per client, median of ``--repeats``:

- ``plain``: pfl's loop: one module, ``load_state_dict`` of the global weights, a new
  ``torch.optim.SGD``, minibatches sliced in order, ``zero_grad()`` (gradients set to None),
  ``loss.backward()``, ``step()``; then the update (weights minus the global weights);
- ``plain_keepgrad``: the same with ``zero_grad(set_to_none=False)`` (gradients accumulated
  into existing tensors, as fedloom's flat gradient buffer is);
- ``plain_fork_rng``: ``plain`` inside ``torch.random.fork_rng`` + ``manual_seed`` per client
  (fedloom's per-client dropout stream);
- ``lean``: fedloom's one-client loop ``local_sgd`` (solvers/local.py) alone, on the same
  plan;
- ``client_update``: ``algorithm.client_update`` (the sequential executor's per-client call:
  random stream, plan, lean loop, upload);
- ``train_round``: ``Engine.train_round`` with ``--clients`` clients a round, per client.

OpenMP's wait policy is the process's: ``import fedloom`` sets ``OMP_WAIT_POLICY=PASSIVE``
unless one of ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME`` is set
(engine/threads.py); run with ``GOMP_SPINCOUNT=300000`` for libgomp's default spinning, what a
plain PyTorch script (pfl's) runs under. ``--profile`` adds torch.profiler's top operators
(self CPU time) for ``plain`` and ``lean``.
See benchmarks/README.md, "sequential_profile.py".
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import peer_settings
import roofline
import round_time
import torch
from torch.nn import functional as F

from fedloom.engine.context import Callback
from fedloom.engine.state import RunState
from fedloom.solvers.local import local_sgd


def plain_client(
    module: torch.nn.Module,
    start: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    lr: float,
    set_to_none: bool = True,
) -> dict[str, torch.Tensor]:
    """pfl's loop for one client: load, new optimizer, in-order minibatches, update."""
    module.load_state_dict(start)
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    opt.zero_grad(set_to_none=set_to_none)
    for i in range(0, len(x), batch):
        loss = F.cross_entropy(module(x[i : i + batch]), y[i : i + batch])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {k: v.detach() - start[k] for k, v in module.state_dict().items()}


def build(n_clients: int) -> tuple[roofline.Runner, list[Any], dict[str, Callable[[], None]]]:
    setting = peer_settings.shrink(peer_settings.SETTINGS["pfl_cifar10"], n_clients, 50, n_clients)
    bench = roofline.peer_bench(setting, quick=False)
    runner = roofline.Runner(bench, "sequential")
    engine = runner.engine
    clients = bench.fed.clients
    params, buffers = engine.model.initial_state(peer_settings.SEED)
    start = {k: v.detach().clone() for k, v in {**params, **buffers}.items()}
    module = setting.model()
    module.load_state_dict(start)
    tasks = engine.tasks_for_round(1, engine.train_ids)
    message = engine.algorithm.server_message(runner.st.server)
    states = [engine.algorithm.init_client_state(runner.st.server, c) for c in engine.train_ids]
    plans = [engine.algorithm.client_plan(t) for t in tasks]
    batch, lr = setting.batch_size, setting.lr

    def plain(set_to_none: bool = True, fork: bool = False) -> Callable[[], None]:
        def go() -> None:
            for k, c in enumerate(clients):
                if fork:
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(k)
                        plain_client(module, start, c.x_train, c.y_train, batch, lr)
                else:
                    plain_client(module, start, c.x_train, c.y_train, batch, lr, set_to_none)

        return go

    def lean() -> None:
        for c, plan in zip(clients, plans, strict=True):
            local_sgd(engine.model, params, buffers, c.x_train, c.y_train, plan, lr)

    def client_update() -> None:
        for t, s in zip(tasks, states, strict=True):
            engine.algorithm.client_update(message, s, t)

    def train_round() -> None:
        engine.train_round(1, RunState(runner.st.server, engine.new_store()))

    contenders = {
        "plain": plain(),
        "plain_keepgrad": plain(set_to_none=False),
        "plain_fork_rng": plain(fork=True),
        "lean": lean,
        "client_update": client_update,
        "train_round": train_round,
    }
    return runner, clients, contenders


def fedloom_run_rounds(rounds: int, extra: dict[str, Any]) -> list[float]:
    """``fedloom.run`` of the full ``pfl_cifar10`` setting with the sequential executor and
    fedloom's defaults (evaluation every 5 rounds, monitoring on) updated by ``extra``: each
    round's seconds, timed by a callback (evaluation and monitoring rounds included)."""
    import fedloom

    setting = peer_settings.SETTINGS["pfl_cifar10"]
    train, test, _ = peer_settings.make_arrays(setting)
    data = fedloom.data.from_arrays(train=train, test=test)
    config = peer_settings.fedloom_config(setting, {"kind": "sequential"})
    config["train"]["rounds"] = rounds
    for key in ("eval", "monitor", "checkpoint"):
        config.pop(key)
    for key, value in extra.items():
        config[key] = value
    marks: list[float] = []

    class Clock(Callback):
        def on_run_start(self, ctx: Any, state: Any) -> None:
            marks.append(time.perf_counter())

        def on_round_end(self, ctx: Any, state: Any, report: Any) -> dict[str, Any]:
            marks.append(time.perf_counter())  # after the round's evaluation and monitoring
            return {}

    fedloom.run(
        config, data=data, model=setting.model(), write=False, progress=False, callbacks=[Clock()]
    )
    return [b - a for a, b in itertools.pairwise(marks)]


def profile(fn: Callable[[], None], rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--fedloom-run",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: fedloom.run on the full setting, defaults against evaluation/monitoring off",
    )
    parser.add_argument("--contenders", default=None, help="comma-separated subset (plain first)")
    args = parser.parse_args(argv)
    if args.fedloom_run:
        variants: dict[str, dict[str, Any]] = {
            "defaults (eval every 5, monitor on)": {},
            "monitor off": {"monitor": {"enabled": False}},
            "eval and monitor off": {"eval": {"every": 10**6}, "monitor": {"enabled": False}},
        }
        for name, extra in variants.items():
            rounds = fedloom_run_rounds(args.fedloom_run, extra)
            text = ", ".join(f"{r:.2f}" for r in rounds)
            print(f"{name}: s/round [{text}], median {statistics.median(rounds[1:]):.2f}")
        return 0
    runner, clients, contenders = build(args.clients)
    if args.contenders:
        names = ["plain", *(n for n in args.contenders.split(",") if n and n != "plain")]
        contenders = {n: contenders[n] for n in names}
    n_threads = args.threads or runner.threads
    times: dict[str, list[float]] = {k: [] for k in contenders}
    with round_time.threads(n_threads):
        for fn in contenders.values():  # warm-up
            fn()
        for _ in range(args.repeats):
            for name, fn in contenders.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) / len(clients))
        base = statistics.median(times["plain"])
        wait = {
            k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ
        }
        print(
            f"threads {n_threads or 'all'}, OpenMP wait {wait}, load {os.getloadavg()[0]:.1f}, "
            f"{len(clients)} clients x 5 steps, ms per client:"
        )
        for name, ts in times.items():
            med = statistics.median(ts)
            ratio = med / base
            print(f"  {name:<16}{med * 1e3:9.2f} ms {ratio:5.2f}x plain (min {min(ts) * 1e3:.2f})")
        if args.profile:
            for name in [n for n in ("plain", "lean") if n in contenders]:
                print(f"\n== torch.profiler: {name} ({len(clients)} clients)")
                print(profile(contenders[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
