"""The Grafana dashboard and the Prometheus alert rules in docker/monitoring/."""
