"""Monitoring the sidecar, shipped as data: the Grafana dashboard (``grafana-sidecar.json``) and
the Prometheus scrape job it expects (``prometheus-scrape.yml``).

Find them with ``importlib.resources.files("overtake.dashboards")``; the Debian package also
installs them under ``/usr/share/overtake/dashboards``.
"""
