#!/usr/bin/env bash
# cellstream's tailer against Debezium with ../shared/peers/debezium (README there), adapted to the store's
# table layout 2: the harness was written for a table per shard (cells_NNNN); the store now keeps one `cells`
# table keyed (shard, added_id). debezium-layout2.patch points the connector at that table and waits for its
# one topic (one partition: Debezium keys a row by its primary key, so more partitions would spread a shard).
#   bench/peers/debezium.sh --runs 2 --cells 50000 --latency-both
# Needs what the harness needs (java 17, mvn, mariadbd, Kafka on :9092, ZooKeeper on :2181).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PEER_SRC="${PEER_DEBEZIUM:-$ROOT/../shared/peers/debezium}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/peer-debezium-harness.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cp -r "$PEER_SRC"/. "$WORK"/
chmod -R u+w "$WORK"
patch -s -d "$WORK" -p1 < "$ROOT/bench/peers/debezium-layout2.patch"
# The harness makes its venv once, with cellstream's base package, from a clone it never updates: make it
# here instead, with the extras the tailer needs, from the checkout's HEAD every time.
PEER="${TMPDIR:-/tmp}/peer-debezium"
mkdir -p "$PEER"
if [ -d "$PEER/cellstream/.git" ]; then
  git -C "$PEER/cellstream" fetch -q "$ROOT" HEAD && git -C "$PEER/cellstream" reset -q --hard FETCH_HEAD
else
  rm -rf "$PEER/cellstream" && git clone -q "$ROOT" "$PEER/cellstream"
fi
# Installed as a user installs it, not editable: pip compiles the modules to bytecode at install. An editable
# install compiled them from source at every start of the tailer wherever PYTHONDONTWRITEBYTECODE is set (as on
# the machine these figures come from), which cost each start of the tailer about 0.05 s.
[ -x "$PEER/venv/bin/pip" ] || python3 -m venv "$PEER/venv"
"$PEER/venv/bin/pip" install -q "$PEER/cellstream[mysql,kafka,zookeeper]"
"$PEER/venv/bin/pip" install -q --no-deps --force-reinstall "$PEER/cellstream"
echo "cellstream $(git -C "$PEER/cellstream" log -1 --format=%h) against Debezium"
CELLSTREAM_SRC="$ROOT" "$WORK/run.sh" "$@"
