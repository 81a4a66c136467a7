"""The pieces of a transformer block, one module per concept."""
