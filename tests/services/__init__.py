"""The servers the suite runs on: the shared ones of scripts/services.sh, the private ones of the harness."""
