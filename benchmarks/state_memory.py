"""Memory of the per-client state store with 10,000 clients holding a 2NN-sized personal model.

    python benchmarks/state_memory.py [--clients 10000] [--storage memory|mmap]

Writes every client's state once (as a personalization algorithm's first round would) and
prints the logical size, the process's peak RSS and the seconds taken, as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from fedloom.engine.state_store import ClientStateStore
from fedloom.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--storage", choices=["memory", "mmap"], default="memory")
    args = parser.parse_args()
    model = build_model("mlp", (1, 28, 28), 10)
    params = {k: v.detach() for k, v in model.named_parameters()}
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    before = rss()
    with tempfile.TemporaryDirectory() as tmp:
        store = ClientStateStore(args.clients, args.storage, Path(tmp) / "state")
        start = time.perf_counter()
        for cid in range(args.clients):
            store.set(cid, {"params": params})
        seconds = time.perf_counter() - start
        row = store.get(args.clients - 1)
        assert row is not None and torch.equal(row["params"]["fc1.weight"], params["fc1.weight"])
        print(
            json.dumps(
                {
                    "clients": args.clients,
                    "storage": args.storage,
                    "params_per_client": sum(v.numel() for v in params.values()),
                    "logical_bytes": store.nbytes(),
                    "peak_rss_increase_bytes": rss() - before,
                    "fill_seconds": round(seconds, 2),
                }
            )
        )


if __name__ == "__main__":
    main()
