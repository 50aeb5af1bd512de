"""The paged KV cache: page allocator, KV tensors, radix prefix tree and per-request bookkeeping."""
