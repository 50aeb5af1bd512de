"""Benchmarks: offline throughput/latency (B1, B2 of BENCHMARKS.md) and the roofline model."""
