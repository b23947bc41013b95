"""dpgrad's device layer (shipped as ``dpgrad.kernels``): launchers, tensors in, tensors out.

``reference`` holds the eager-PyTorch version of every launcher; it is the CPU fallback and
the test oracle. Nothing here imports the rest of dpgrad.
"""

from . import reference

__all__ = ["reference"]
