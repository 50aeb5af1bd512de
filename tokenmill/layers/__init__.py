"""Building blocks of decoder models: linear projections, norms, rotary embedding, activations."""
