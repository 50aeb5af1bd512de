"""Attention backends: a small interface, a registry, and the implementations."""
