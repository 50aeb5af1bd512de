"""Inter-process messages (msgspec structs) and ZeroMQ socket helpers."""
