"""Test-session setup shared by every test module.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. It must be
switched on before anything imports the kernels, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
