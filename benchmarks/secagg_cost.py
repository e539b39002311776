"""Cost of one SecAgg / SecAgg+ round: 100 clients, d = 199,210 (the 2NN's parameters).

    python benchmarks/secagg_cost.py [--clients 100] [--dim 199210] [--repeats 3]
                                     [--dropouts 0,0.1]

For SecAgg+ (default k and t) and SecAgg (t = n // 2 + 1), with 0% and 10% (--dropouts) of the
clients dropping after ShareKeys (before MaskedInput, so their s_v^sk is rebuilt and their pairwise
masks removed: the expensive case), prints the median seconds per round by phase and the
bytes up and down per sampled client as a markdown table, then one JSON line. The whole
simulated round runs in this one process on one core (every client's work and the server's,
one after another), so a round's seconds are the sum of all parties' compute; a real client
does about 1/n of the client-side part.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedloom.secure.base import DropStage
from fedloom.secure.secagg import SecAgg, SecAggPlus
from fedloom.secure.secagg_graph import default_neighbours, default_threshold

PHASES = ("quantize", "advertise_keys", "share_keys", "masked_input", "unmasking", "total")


def measure(protocol: SecAgg | SecAggPlus, clients: int, dim: int, dropout: float, repeats: int):
    rng = np.random.default_rng(0)
    vectors = {u: rng.normal(scale=0.05, size=dim).astype(np.float32) for u in range(clients)}
    dropped = rng.choice(clients, size=int(dropout * clients), replace=False)
    drops: dict[int, DropStage] = {int(u): "shares" for u in dropped}
    runs = [protocol.sum(r, vectors, drops) for r in range(repeats + 1)][1:]  # one warm-up
    seconds = {p: statistics.median(run.seconds[p] for run in runs) for p in PHASES}
    return {
        "seconds": seconds,
        "bytes_up_per_client": runs[0].bytes_up / clients,
        "bytes_down_per_client": runs[0].bytes_down / clients,
        "included": len(runs[0].included),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Print the table and the JSON line for ``argv`` (the command line by default); return
    the JSON line's object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--dim", type=int, default=199_210)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dropouts", default="0,0.1", help="comma-separated fractions")
    args = parser.parse_args(argv)
    dropouts = [float(f) for f in args.dropouts.split(",") if f.strip()]
    k = default_neighbours(args.clients)
    protocols = {
        f"SecAgg+ (k={k}, t={default_threshold(k + 1)})": SecAggPlus(),
        f"SecAgg (t={default_threshold(args.clients)})": SecAgg(),
    }
    results = {}
    header = "| protocol | dropout | " + " | ".join(PHASES) + " | KB up/client | KB down/client |"
    print(
        f"{args.clients} clients, d = {args.dim:,}; seconds per round (median of "
        f"{args.repeats}), all parties on one core\n"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, protocol in protocols.items():
        for dropout in dropouts:
            row = measure(protocol, args.clients, args.dim, dropout, args.repeats)
            results[f"{name} dropout={dropout}"] = row
            cells = " | ".join(f"{row['seconds'][p]:.3f}" for p in PHASES)
            print(
                f"| {name} | {dropout:.0%} | {cells} | {row['bytes_up_per_client'] / 1e3:,.1f} | "
                f"{row['bytes_down_per_client'] / 1e3:,.1f} |"
            )
    print(f"\nplaintext float32 upload: {4 * args.dim / 1e3:,.1f} KB/client")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
