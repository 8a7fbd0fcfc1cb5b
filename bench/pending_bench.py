"""How long `cellstream pending --json` takes while a storage node is down (issue 52, item 5: it took about 6 s).

    python bench/pending_bench.py [--server URL] [--runs 5]

An instance of two storage nodes: node a on a private MariaDB (tests/harness/private_mariadb.py), node b a
fresh database on the server at ``--server``. `cellstream pending --json --store CLUSTER` is run as an operator
runs it (a new process each time), ``--runs`` times with both nodes up, then as many with node a's mariadbd
SIGKILLed (connections refused at once) and three writes buffered for it. Printed: each state's median, and
their ratio, which is the figure (the interpreter's start is in both); written to ``bench/results/pending.json``.
The down runs must still list node a as unreachable and its three cells as waiting (exit 5), or the run fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import logstore
from bench.scratch import drop_database
from tests.harness.private_mariadb import PrivateMariaDB

RESULTS = Path(__file__).resolve().parent / "results" / "pending.json"
TARGET = 3.0  # down / up: answering within about a second of the healthy run
SHARDS = 64


def timed_runs(cluster: Path, runs: int, expect: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "cellstream", "pending", "--json", "--store", str(cluster)],
                              capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - started)
        if done.returncode != expect:
            raise SystemExit(f"`cellstream pending` exited {done.returncode}, not {expect}: {done.stderr[-500:]}")
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    b_url = f"{args.server}/bench_pending_{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="pending-bench-") as work, PrivateMariaDB(Path(work) / "a") as db:
        cluster = Path(work) / "cluster.toml"
        cluster.write_text(f'shards = {SHARDS}\n[[nodes]]\nname = "a"\nurl = "{db.url("cells")}"\n'
                           f'shards = "0-{SHARDS // 2 - 1}"\n[[nodes]]\nname = "b"\nurl = "{b_url}"\n'
                           f'shards = "{SHARDS // 2}-{SHARDS - 1}"\n')
        try:
            with logstore.open(cluster) as store:
                up = timed_runs(cluster, args.runs, 0)
                db.kill()
                keys = (k for k in iter(uuid.uuid4, None) if store.node_of(store.shard_of(k)) == "a")
                for n in range(3):
                    if store.put_cell(next(keys), "BASE", 1, {"n": n}).added_id != 0:
                        raise SystemExit("a write to the killed node was not buffered")
            down = timed_runs(cluster, args.runs, 5)
            listed = subprocess.run([sys.executable, "-m", "cellstream", "pending", "--json", "--store", str(cluster)],
                                    capture_output=True, text=True, check=False).stdout
            if json.loads(listed) != {"homes": {"a": {"waiting": 3, "failed": 0, "held_on": {
                    "b": {"waiting": 3, "failed": 0}}}}, "unreachable": ["a"]}:
                raise SystemExit(f"`cellstream pending` did not list what waits: {listed}")
        finally:
            drop_database(b_url)
    up_s, down_s = statistics.median(up), statistics.median(down)
    return {"runs": args.runs, "up_median_s": up_s, "down_median_s": down_s, "ratio": down_s / up_s,
            "down_max_s": max(down)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="mysql://cellstream:cellstream@127.0.0.1:3306")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    r = run(args)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(r, indent=2) + "\n")
    print(f"`cellstream pending --json`, median of {r['runs']}: {r['up_median_s']:.2f} s with both nodes up, "
          f"{r['down_median_s']:.2f} s with node a SIGKILLed (max {r['down_max_s']:.2f}); ratio {r['ratio']:.2f} "
          f"(target <= {TARGET:g}: {'met' if r['ratio'] <= TARGET else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
