"""The torch and Triton versions dpgrad supports, written once, and a warning on import when the
installed ones are outside them.

pyproject.toml's requirements (``torch>=2.6,<2.14``, the ``[triton]`` extra's
``triton>=3.6,<3.10``) and the README's install section state the same ranges;
tests/test_install.py checks that they agree with ``SUPPORTED``.

A range is of release series (major.minor), as the README states it: ``2.13.0+cpu`` and a
``2.13.1`` are torch 2.13; ``2.14.0.dev20261101`` (a nightly) is 2.14, outside. The version
strings are read by hand rather than with ``packaging``, which a virtual environment holding only
torch does not have. The check costs one metadata lookup (Triton is not imported) and warns once
per process.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import warnings
from typing import Dict, List, Optional, Tuple

Release = Tuple[int, int]

# {distribution: (oldest supported release series, newest supported release series)}.
SUPPORTED: Dict[str, Tuple[Release, Release]] = {
    "torch": ((2, 6), (2, 13)),
    "triton": ((3, 6), (3, 9)),
}
# The distributions that install the ``triton`` module: PyPI's, and the one torch's nightlies pin.
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton")

_RELEASE = re.compile(r"\s*v?(?:\d+!)?(\d+)\.(\d+)")
_warned = False


class UnsupportedVersionWarning(UserWarning):
    """torch or Triton is outside the versions this dpgrad release is tested with."""


def release(version: str) -> Optional[Release]:
    """The release series (major, minor) of a version string (``"2.13.0+cpu"`` -> ``(2, 13)``,
    ``"2.14.0.dev20261101"`` -> ``(2, 14)``); None when it does not start with one."""
    match = _RELEASE.match(version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def requirement(name: str) -> str:
    """The pip requirement for a supported version of ``name``: ``"torch>=2.6,<2.14"``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED[name]
    return f"{name}>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"


def described(name: str) -> str:
    """The range in words, as the README writes it: ``"torch 2.6 to 2.13"``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED[name]
    label = "Triton" if name == "triton" else name
    return f"{label} {lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def installed(name: str) -> Optional[str]:
    """The installed version of ``name`` ("torch" or "triton"); None when it is not installed.
    torch is imported already (dpgrad needs it); Triton's version comes from its metadata, so that
    importing dpgrad does not import Triton."""
    if name == "torch":
        import torch

        return str(torch.__version__)
    for distribution in TRITON_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        if version:
            return version
    return None


def unsupported() -> List[str]:
    """One phrase per installed package outside its supported range (empty when all are in)."""
    problems = []
    for name, (oldest, newest) in SUPPORTED.items():
        version = installed(name)
        if version is None:
            continue
        series = release(version)
        if series is None:
            problems.append(f"{described(name)}, but the installed version {version!r} cannot be read")
        elif not oldest <= series <= newest:
            problems.append(f"{described(name)}, but {version} is installed")
    return problems


def _caller_level() -> int:
    """The ``stacklevel`` of the user's frame that imported dpgrad, so the warning names the user's
    ``import`` line: past dpgrad's own frames (``warnings`` skips the import machinery's)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_unsupported() -> None:
    """Warn (``UnsupportedVersionWarning``, once per process) when the installed torch or Triton
    is outside ``SUPPORTED``, naming the versions, the ranges and what to do."""
    global _warned
    if _warned:
        return
    problems = unsupported()
    if not problems:
        return
    _warned = True
    from .version import __version__

    fix = " ".join(f'"{requirement(name)}"' for name in SUPPORTED)
    warnings.warn(
        f"dpgrad {__version__} supports " + "; ".join(problems) + ". Other versions are untested: "
        f"dpgrad may fail or give wrong results with them. Install supported versions with "
        f"pip install {fix} (Triton runs only dpgrad's CUDA kernels: without it, or with "
        f"DPGRAD_BACKEND=eager, they run in PyTorch instead).",
        UnsupportedVersionWarning, stacklevel=_caller_level())
