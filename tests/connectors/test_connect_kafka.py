"""`cellstream connect` reading the tailer's Kafka topics, on a Kafka cluster of its own that has never seen a
consumer group: the first group lookup of a broker creates ``__consumer_offsets`` and answers "coordinator not
available" until it is there, which `connect status` and `connect run` wait out instead of failing."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from tests.connectors.test_connect_parquet import CONFIG, SHARDS, lake, source, trips
from tests.harness.kafka_support import publish
from tests.harness.services import PrivateKafka


def test_a_kafka_source_on_a_fresh_cluster_loads_the_topics_and_commits_through_the_checkpoint(
        sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = f"k{uuid.uuid4().hex[:8]}"
    with PrivateKafka(tmp_path / "kafka") as kafka, logstore.open(sqlite_url, shards=SHARDS) as store:
        path = tmp_path / "sink.yaml"
        path.write_text(CONFIG.format(interval=0.2, rows=100_000)
                        + f"brokers: {kafka.bootstrap}\ntopic_prefix: {prefix}\n")
        trips(store, 100)
        publish(store, prefix, brokers=kafka.bootstrap)

        def status() -> list[dict[str, Any]]:
            code = main(["connect", "status", str(path), "--store", sqlite_url, "--json", "--shards"])
            captured = capsys.readouterr()
            assert code == 0, captured.err
            [totals] = [json.loads(line) for line in captured.out.splitlines()]
            rows: list[dict[str, Any]] = totals["partitions"]
            assert {row["topic"] for row in rows} == {f"{prefix}.BASE", f"{prefix}.FARE"}
            assert totals["lag_messages"] == sum(row["lag_messages"] for row in rows)
            return rows

        assert sum(row["lag_messages"] for row in status()) == 200  # nothing committed yet
        for expected in (200, 0):  # the second run starts from the offsets the first committed
            code = main(["connect", "run", str(path), "--drain", "--store", sqlite_url, "--json"])
            captured = capsys.readouterr()
            assert code == 0, captured.err
            assert json.loads(captured.out.splitlines()[-1])["processed"] == expected
            for column in ("BASE", "FARE"):
                assert lake(tmp_path / "lake", column) == source(store, column)
        assert all(row["lag_messages"] == 0 and row["committed"] is not None for row in status())
