"""Speculative decoding: proposers (n-gram, draft model) and the rejection-sampling verifier."""
