"""The model runner: batch inputs → forward → sampled tokens."""
