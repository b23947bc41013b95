"""Test-session setup shared by every test module.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. It must be
switched on before anything imports the kernels, hence here. The autotuner's store goes to a
directory of this session, never the user's cache, and the suite chooses kernels by the cost
model (DPGRAD_TUNE=off: the same choices on every machine); tuning tests turn timing on.
"""

import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DPGRAD_TUNE", "off")
os.environ["DPGRAD_TUNE_DIR"] = tempfile.mkdtemp(prefix="dpgrad-tune-")
