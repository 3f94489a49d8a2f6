"""Prometheus and Grafana files for stream_ctr (installed as `stream_ctr.monitoring`).

Data, not code: the Prometheus scrape configs (`prometheus.yml`, one trainer;
`prometheus-ranks.yml`, several ranks), the alert rules and their promtool
tests, and the Grafana dashboard with its provisioning files. They use only
metric names from `stream_ctr.telemetry.catalogue` (a test checks).
`stream-ctr monitoring export DIR` writes them out of an installed wheel;
`build_dashboard.py` generates the dashboard JSON; it imports nothing of
stream_ctr, and nothing imports this package (its files are read as data).
"""
