"""Tensor parallelism: the process group of the ranks that share one model."""
