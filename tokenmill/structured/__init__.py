"""Structured outputs: grammars compiled off the scheduler thread, matchers and token bitmasks."""
