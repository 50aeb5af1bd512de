"""Metrics (Prometheus), request traces and profiling hooks."""
