"""Cost of homomorphically encrypted FedAvg per round: Paillier (packed) and CKKS
(docs/secure_aggregation.md).

    python benchmarks/he_cost.py [--clients 100] [--dim 199210] [--schemes paillier-2048,...]
                                 [--budget-s 150] [--threads 1]

Defaults: 100 clients, d = 199,210 (the 2NN's parameter count), clip 1, f = 16, slots sized
for all the clients (max_clients = --clients). Each scheme runs the protocol's roles (clients
encrypt, the server folds each upload into the aggregate as it arrives, the key authority
decrypts once) on random updates in [-0.1, 0.1]. Clients are encrypted one after another
until --budget-s seconds are spent (at least 2): when that stops short of --clients, the
per-client times are averaged over the measured clients and the round's client-side and
server-side totals are extrapolated linearly to --clients (the table says how many were
measured). Decryption cost does not depend on the number of clients and is always measured.
Times are single-core (phe is single-threaded; TenSEAL gets --threads). "round s, serial"
is a simulation's cost (every client on this one core); "round s, parallel clients" is a
deployment's wall time (clients encrypt at once; the server folds and the key authority
decrypts). The public key (CKKS: public context) goes down to each client once, not per round.

Prints a markdown table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fedloom.secure.ckks import CHUNK, CKKSAggregation
from fedloom.secure.encrypted_fedavg import PaillierAggregation
from fedloom.secure.he_protocol import EncryptedAggregation

CLIP, FRAC_BITS = 1.0, 16
SCHEMES = ("paillier-2048", "paillier-1024", "ckks")


@dataclass
class Cost:
    scheme: str
    values_per_ciphertext: int
    ciphertexts_per_client: int
    bytes_per_client: int
    encrypt_s_per_client: float
    aggregate_s_per_client: float
    decrypt_s: float
    round_serial_s: float
    round_parallel_s: float
    key_bytes: int
    clients: int
    measured_clients: int
    max_abs_error_sum: float


def update(dim: int, client: int) -> np.ndarray:
    return np.random.default_rng(client).uniform(-0.1, 0.1, dim)


def build(scheme: str, clients: int, threads: int) -> tuple[EncryptedAggregation, int]:
    """The aggregator and its values per ciphertext."""
    if scheme == "ckks":
        return CKKSAggregation(CLIP, n_threads=threads), CHUNK
    key_bits = int(scheme.split("-")[1])
    agg = PaillierAggregation(CLIP, FRAC_BITS, key_bits=key_bits, max_clients=clients)
    return agg, agg.packing.slots


def measure(scheme: str, clients: int, dim: int, budget_s: float, threads: int) -> Cost:
    agg, per_ct = build(scheme, clients, threads)
    agg.server.begin(0)
    encrypt_s = aggregate_s = 0.0
    upload_bytes, plain = 0, np.zeros(dim)
    measured = 0
    start = time.perf_counter()
    while measured < clients and (measured < 2 or time.perf_counter() - start < budget_s):
        x = update(dim, measured)
        tick = time.perf_counter()
        upload = agg.client(measured).upload(0, x)
        encrypt_s += time.perf_counter() - tick
        upload_bytes = agg.message_bytes(upload)
        tick = time.perf_counter()
        agg.server.receive(upload)
        aggregate_s += time.perf_counter() - tick
        plain += x
        measured += 1
        print(f"{scheme}: client {measured} encrypted", file=sys.stderr, flush=True)
    tick = time.perf_counter()
    request = agg.server.decrypt_request()
    aggregate_s += time.perf_counter() - tick
    tick = time.perf_counter()
    answer = agg.key_authority.decrypt(request)
    decrypt_s = time.perf_counter() - tick
    total, _ = agg.decode(answer, dim)
    per_client_encrypt, per_client_aggregate = encrypt_s / measured, aggregate_s / measured
    return Cost(
        scheme=scheme,
        values_per_ciphertext=per_ct,
        ciphertexts_per_client=len(upload.ciphertexts),
        bytes_per_client=upload_bytes,
        encrypt_s_per_client=per_client_encrypt,
        aggregate_s_per_client=per_client_aggregate,
        decrypt_s=decrypt_s,
        round_serial_s=clients * (per_client_encrypt + per_client_aggregate) + decrypt_s,
        round_parallel_s=per_client_encrypt + clients * per_client_aggregate + decrypt_s,
        key_bytes=agg.public_key_message()[1],
        clients=clients,
        measured_clients=measured,
        max_abs_error_sum=float(np.max(np.abs(total - plain))),
    )


def table(costs: list[Cost], dim: int) -> str:
    rows = [
        "| scheme | values/ct | ct/client | MB/client | B/value | encrypt s/client "
        "| server s/client | server s/round | KA decrypt s | round s, serial | round s, "
        "parallel clients | key KB down (once) | measured | max err (sum) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in costs:
        measured = f"{c.measured_clients}/{c.clients}" + (
            "" if c.measured_clients == c.clients else " (extrapolated)"
        )
        rows.append(
            f"| {c.scheme} | {c.values_per_ciphertext:,} | {c.ciphertexts_per_client:,} "
            f"| {c.bytes_per_client / 1e6:.2f} | {c.bytes_per_client / dim:.1f} "
            f"| {c.encrypt_s_per_client:.2f} | {c.aggregate_s_per_client:.3f} "
            f"| {c.aggregate_s_per_client * c.clients:.1f} | {c.decrypt_s:.2f} "
            f"| {c.round_serial_s:.0f} | {c.round_parallel_s:.1f} | {c.key_bytes / 1e3:.1f} "
            f"| {measured} | {c.max_abs_error_sum:.1e} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Print the table and the JSON line for ``argv`` (the command line by default); return
    the JSON line's object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--dim", type=int, default=199_210)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    for scheme in schemes:
        if scheme not in SCHEMES:
            parser.error(f"unknown scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    if args.clients < 2:
        parser.error("--clients must be at least 2 (the key authority's min_contributors)")
    costs = [measure(s, args.clients, args.dim, args.budget_s, args.threads) for s in schemes]
    print(f"{args.clients} clients, d = {args.dim:,}, clip {CLIP}, f = {FRAC_BITS}\n")
    print(table(costs, args.dim))
    results = {"clients": args.clients, "dim": args.dim, "costs": [asdict(c) for c in costs]}
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
