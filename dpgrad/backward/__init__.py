"""The backward machinery: the hooks' records of a pass, the finish (norms, coefficients,
clipped sums) and the hand-off of the clipped gradients to ``p.grad``, FSDP2's included."""
