"""How per-sample gradients are clipped: the bounds and coefficients, clipping groups (per layer,
per block), and adaptive clipping."""
