"""L2SGD+ against L2SGD on least-squares clients (5 clients of 100 samples, the quadratic
dataset): the relative distance of the personal models theta_k and of theta_bar to the solution
of the mixed problem, computed in closed form (tests/algorithms/oracle.py), after a number of
rounds, with minibatches of 20 samples (stochastic gradients).

    python benchmarks/l2sgd_plus.py --rounds 60 100 150 300 --lr 0.1 0.4

The last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.algorithms.oracle import (
    as_vector,
    l2sgd_mixed_solution,
    quadratic_data,
    run,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[60, 100, 150, 300])
    parser.add_argument("--lr", type=float, nargs="+", default=[0.4])
    parser.add_argument("--lam", type=float, default=1.0)
    parser.add_argument("--p", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=20)
    args = parser.parse_args()
    data = quadratic_data(num_clients=5, seed=0, samples=100, feature_skew=False)
    bar, thetas = l2sgd_mixed_solution(data, args.lam)
    rows = []
    for name in ("l2sgd_plus", "l2sgd"):
        for lr in args.lr:
            for rounds in args.rounds:
                algorithm = {"name": name, "lam": args.lam, "p": args.p}
                result = run(data, algorithm, rounds, lr, batch_size=args.batch_size)
                personal = max(
                    float((as_vector(result.client_params[k]) - t).norm() / t.norm())
                    for k, t in enumerate(thetas)
                )
                average = float((as_vector(result.global_params) - bar).norm() / bar.norm())
                rows.append(
                    {
                        "algorithm": name,
                        "lr": lr,
                        "rounds": rounds,
                        "theta_k": personal,
                        "theta_bar": average,
                    }
                )
                print(
                    f"{name:10s} lr {lr:g} rounds {rounds:4d}: max_k |theta_k - theta_k*| / "
                    f"|theta_k*| {personal:.2e}, theta_bar {average:.2e}",
                    flush=True,
                )
    print(json.dumps({"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
