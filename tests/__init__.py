"""The suite, by subject (each folder a package; run one with ``pytest tests/<folder>``):

    logstore/    cells, retries, the SQLite and MariaDB backends, replication, buffered writes, shard moves
    node/        the worker node (``cellstream serve``): the logstore contract over HTTP, its server, OpenAPI
    tailer/      the tailer: assignment, order, shards, standalone files, Kafka and ZooKeeper, faults
    indexer/     the app runtime: direct mode, Kafka mode, distributed over ZooKeeper (DLQ and retries in each)
    indexes/     secondary indexes: definitions, tables, runtime, versions, verify, group commit
    connectors/  the Parquet sink and ``cellstream connect`` into the lake and PostgreSQL
    cli/         the ``cellstream`` command through main(argv), the demo, ``run`` and ``dlq``
    services/    the servers the suite runs on: the shared ones answer, the private ones survive kills
    contracts/   the test cases every backend runs (subclassed in logstore/, node/ and indexes/)
    harness/     helpers, not tests: server addresses, private servers, proxies, Kafka readers, ...

Fixtures are in conftest.py, which also marks each test with the services it needs (mysql, postgres, kafka,
zookeeper); ``make unit`` runs the tests with none of them, without any server.
"""
