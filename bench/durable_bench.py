"""The price of durable buffered writes (issue 52, "Benchmarks": durable buffered write p50 <= 2x a plain put).

    python bench/durable_bench.py [--server URL] [--replica URL] [--shards 4096] [--puts 2000] [--rounds 4]

An instance of two storage nodes on the MariaDB at ``--server``: node a a fresh ``csr_`` database, which the
replica at ``--replica`` replicates (the shared pair `make test` starts), node b another database. The same
process opens it twice, with ``durable_writes`` on and off, and puts single cells into node a's shards (one
``put_cell`` each, a new key), alternating the two stores round by round (ABBA). Printed: each mode's p50 and
p99 and the ratio of the p50s; written to ``bench/results/durable.json``. A durable put is the plain put and
one more write (the copy, on node b), so the ratio's floor is about 2 on one server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import logstore
from bench.scratch import drop_database

RESULTS = Path(__file__).resolve().parent / "results" / "durable.json"


def keys_on_a(store: logstore.Store, n: int) -> list[uuid.UUID]:
    out: list[uuid.UUID] = []
    while len(out) < n:
        key = uuid.uuid4()
        if store.node_of(store.shard_of(key)) == "a":
            out.append(key)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    a_url, b_url = f"{args.server}/csr_bench_{tag}", f"{args.server}/bench_durable_{tag}"
    replica = f"{args.replica}/csr_bench_{tag}"
    cluster = Path(f"/tmp/durable-bench-{tag}.toml")
    half = args.shards // 2
    cluster.write_text(f'shards = {args.shards}\n[[nodes]]\nname = "a"\nurl = "{a_url}"\nreplicas = ["{replica}"]\n'
                       f'shards = "0-{half - 1}"\n[[nodes]]\nname = "b"\nurl = "{b_url}"\n'
                       f'shards = "{half}-{args.shards - 1}"\n')
    try:
        with logstore.open(cluster, durable_writes=True) as durable, logstore.open(cluster) as plain:
            keys = keys_on_a(plain, args.puts * args.rounds * 2 + 100)
            for key in keys[:100]:  # warm both stores' pools
                (durable if key.int % 2 else plain).put_cell(key, "warm", 1, {"w": 1})
            times: dict[str, list[float]] = {"durable": [], "plain": []}
            at = 100
            for r in range(args.rounds):
                order = [("plain", plain), ("durable", durable)] if r % 2 == 0 else [("durable", durable),
                                                                                    ("plain", plain)]
                for name, store in order:
                    for _ in range(args.puts):
                        started = time.perf_counter()
                        store.put_cell(keys[at], "bench", 1, {"n": at, "pad": "x" * 100})
                        times[name].append(time.perf_counter() - started)
                        at += 1
            held = sum(n for r in map(durable.node_recorder, durable.nodes) if r for n in r.copy_counts().values())
    finally:
        drop_database(a_url)
        drop_database(b_url)
        cluster.unlink(missing_ok=True)

    def p(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
    d50, p50 = statistics.median(times["durable"]), statistics.median(times["plain"])
    return {"shards": args.shards, "puts": args.puts * args.rounds, "copies_held_at_end": held,
            "plain_p50_ms": p50 * 1000, "plain_p99_ms": p(times["plain"], 99) * 1000,
            "durable_p50_ms": d50 * 1000, "durable_p99_ms": p(times["durable"], 99) * 1000, "ratio_p50": d50 / p50}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="mysql://cellstream:cellstream@127.0.0.1:3306")
    parser.add_argument("--replica", default="mysql://cellstream:cellstream@127.0.0.1:3307")
    parser.add_argument("--shards", type=int, default=4096)
    parser.add_argument("--puts", type=int, default=500, help="puts of each mode in a round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    r = run(args)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(r, indent=2) + "\n")
    print(f"{r['shards']} shards, {r['puts']} single puts each: plain p50 {r['plain_p50_ms']:.2f} ms (p99 "
          f"{r['plain_p99_ms']:.2f}), durable p50 {r['durable_p50_ms']:.2f} ms (p99 {r['durable_p99_ms']:.2f}); "
          f"ratio {r['ratio_p50']:.2f} (target <= 2.0: {'met' if r['ratio_p50'] <= 2.0 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
