"""The servers the suite runs on: the shared ones of tests/harness/servers.py, the private ones of the harness."""
