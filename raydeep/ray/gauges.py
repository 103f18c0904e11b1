"""Prometheus gauges of a run's latest step, through Ray's metrics agent (``ray.util.metrics``):
Ray exports them with its own metrics, so a cluster's Prometheus and Grafana (or the Ray
dashboard's metrics view) chart a run as it trains. Rank 0 sets them once per step; the tag
``run`` is the run's name, so several runs on one cluster stay apart.

Setting the four costs about 10 microseconds per step (1000 sets of all four timed in a Ray
worker), so they are set every step. A value not known for the run (MFU on a CPU) is not set.
"""
from __future__ import annotations

# Gauge name -> (the step event's key, the description Prometheus shows).
GAUGES = {
    "raydeep_loss": ("loss", "training loss of the latest optimizer step"),
    "raydeep_tokens_per_s": ("tokens_s", "tokens per second over all workers in the latest step"),
    "raydeep_mfu": ("mfu", "model FLOPs utilisation of the latest step (0-1)"),
    "raydeep_step_s": ("seconds", "wall seconds of the latest optimizer step"),
}


class StepGauges:
    """The run's gauges, set from rank 0's step events (see the module docstring)."""

    def __init__(self, run_name: str):
        from ray.util.metrics import Gauge

        self.gauges = []
        for name, (key, description) in GAUGES.items():
            gauge = Gauge(name, description=description, tag_keys=("run",))
            gauge.set_default_tags({"run": run_name})
            self.gauges.append((key, gauge))

    def set(self, event: dict) -> None:
        for key, gauge in self.gauges:
            value = event.get(key)
            if value is not None:
                gauge.set(float(value))
