"""The engine core: request state, the scheduler and the step loop."""
