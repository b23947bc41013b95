"""Test-session setup shared by every test module.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. It must be
switched on before anything imports the kernels, hence here. The autotuner's store goes to a
directory of this session, never the user's cache, and the suite chooses kernels by the cost
model (DPGRAD_TUNE=off: the same choices on every machine); tuning tests turn timing on.
"""

import atexit
import gc
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DPGRAD_TUNE", "off")
os.environ["DPGRAD_TUNE_DIR"] = tempfile.mkdtemp(prefix="dpgrad-tune-")
atexit.register(shutil.rmtree, os.environ["DPGRAD_TUNE_DIR"], ignore_errors=True)  # each process its own
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    # The workers share the cores: one thread each, not each a thread per core; and so do the
    # processes they start (ranks spawned, pytest or the CLI in a subprocess), which read it
    # from the environment.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda_error_ends_the_process():
    """A CUDA error such as an illegal address is sticky: every later test of this process
    would fail with it and hide which test caused it. After each test on a GPU, synchronise;
    on an error, end the process (pytest-xdist reports the test as crashed and starts a fresh
    worker), so the failures that follow are each test's own."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - any CUDA error leaves the context unusable
            import sys

            print(f"\nCUDA error after this test, ending the process: {exc}", file=sys.stderr, flush=True)
            os._exit(3)


def pytest_collection_finish(session):
    """What the imports and the collection made (torch's, transformers' and the test modules'
    objects, hundreds of thousands) lives as long as the session: moved out of the collector's
    reach, so that each full collection (Python's own, and the one the Trainer runs at each
    ``train()``) looks at the tests' objects only, not at every module's again."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's exit frees them as usual


def pytest_collection_modifyitems(config, items):
    """Mark ``kernel_paths`` the tests of ``tests/triton_pass.txt``: the Makefile's second pass
    (``DPGRAD_BACKEND=triton ... -m kernel_paths``) runs them. Where that pass runs, a listed
    test of a collected module that is not found (renamed, its parameters changed) stops it:
    choose the list afresh (``tests/triton_pass.py``)."""
    from triton_pass import listed, test_id

    wanted = set(listed())
    found = set()
    for item in items:
        node = test_id(item.nodeid)
        if node in wanted:
            item.add_marker(pytest.mark.kernel_paths)
            found.add(node)
    if "kernel_paths" in (config.option.markexpr or ""):
        modules = {test_id(item.nodeid).split("::", 1)[0] for item in items}
        missing = sorted(t for t in wanted - found if t.split("::", 1)[0] in modules)
        if missing:
            raise pytest.UsageError(f"tests/triton_pass.txt names tests not collected: {missing}; "
                                    "choose the list afresh with tests/triton_pass.py")
