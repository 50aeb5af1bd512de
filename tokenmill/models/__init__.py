"""Model implementations, the architecture registry and the checkpoint loader."""
