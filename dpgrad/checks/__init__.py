"""The checks that keep the guarantee: every trainable parameter clipped, each sample's outputs
its own (independence), and the model's layers usable."""
