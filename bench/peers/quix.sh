#!/usr/bin/env bash
# cellstream's Kafka-mode App beside Quix Streams, faust-streaming and raw aiokafka on one topic, with
# ../shared/peers/quix (README there): the figures of issue 55 in docs/benchmarks.md, "Kafka mode against
# Quix Streams". Needs Kafka on 127.0.0.1:9092 and the venv of `make test`:
#   .venv/bin/python -m tests.harness.servers run -- bench/peers/quix.sh --latency-systems raw,app,quix
#   bench/peers/quix.sh --systems "" --latency-systems app,quix,raw --rate 10000 --seconds 10
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PEER_SRC="${PEER_QUIX:-$ROOT/../shared/peers/quix}"
cd "$ROOT"
exec "$PEER_SRC/run.sh" "$@"
