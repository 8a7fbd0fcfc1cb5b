"""What the tests share, none of it a test: the shared servers' addresses (shared_servers), private servers a
test may kill (services: ZooKeeper and Kafka; private_mariadb), a TCP proxy that cuts connections (faults),
Kafka readers and publishing (kafka_support), a worker node in a thread (worker_support), store helpers
(stores), the index tests' seed and brute-force expectation (index_support), and the app process the fault
tests SIGKILL (app_worker, run as a file).  The fixtures are in tests/conftest.py."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: subprocesses import its packages from here
