"""Evaluations of a live deployment: conformance with a reference, and the user's tasks."""
