"""Building blocks written for tensor parallelism: linear, embedding, attention, RoPE, norm, activation."""
