"""Helpers that build tiny real checkpoints offline, for tests, examples and benchmarks."""
