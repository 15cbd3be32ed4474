"""Prometheus metrics and the /metrics, /healthz, /readyz endpoints."""

from stage.observability.metrics import PREFIX, PrometheusSink
from stage.observability.server import HealthServer

__all__ = ["HealthServer", "PREFIX", "PrometheusSink"]
