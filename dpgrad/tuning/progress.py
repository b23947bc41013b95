"""A progress bar while the autotuner measures (``DPGRAD_TUNE=on``, new layer shapes): the
first step of a model can take seconds to minutes, the kernels compiled and timed shape by
shape.

One tqdm bar on stderr, opened at the first shape measured in a backward pass, advanced per
shape with its name, and closed (it leaves no line) when the pass ends. Off where stderr is
not a terminal (tqdm's own rule, as in the Hugging Face Trainer), and with
``DPGRAD_PROGRESS=0``. A pass that measures nothing opens nothing: steps after the first
cost one attribute test.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional

PROGRESS_ENV_VAR = "DPGRAD_PROGRESS"


def progress_wanted(stream=None) -> bool:
    """Whether to show progress on ``stream`` (stderr): it is a terminal and
    ``DPGRAD_PROGRESS`` is not ``0``; ``DPGRAD_PROGRESS=1`` shows it on any stream."""
    setting = os.environ.get(PROGRESS_ENV_VAR, "")
    if setting == "0":
        return False
    if setting == "1":
        return True
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


def progress_bar(desc: str, total: Optional[int] = None, unit: str = "", stream=None, **options):
    """A tqdm bar on ``stream`` (stderr) where ``progress_wanted`` says so, else None. Redrawn
    at each update (``mininterval=0``: the steps counted here take seconds)."""
    stream = sys.stderr if stream is None else stream
    if not progress_wanted(stream):
        return None
    from tqdm import tqdm

    return tqdm(desc=desc, total=total, unit=unit, file=stream, mininterval=0, **options)


class TuningProgress:
    """The bar of the shapes measured in the current backward pass."""

    def __init__(self):
        self.bar = None
        self.hidden_by = 0  # callers showing a progress display of their own

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """No bar while inside (a caller, such as the autotune report, shows its own)."""
        self.hidden_by += 1
        try:
            yield
        finally:
            self.hidden_by -= 1

    def measuring(self, label: str) -> None:
        """A shape is about to be measured: open the bar (once per pass) and name the shape."""
        if self.bar is None:
            if self.hidden_by:
                return
            self.bar = progress_bar("dpgrad autotune", unit=" shapes", leave=False,
                                    bar_format="{desc}: {n_fmt} shapes measured [{elapsed}]{postfix}")
            if self.bar is None:
                return
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.refresh()

    def measured(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def end(self) -> None:
        """The backward pass ended (or failed): close the bar if one is open."""
        bar: Optional[object] = self.bar
        if bar is not None:
            self.bar = None
            bar.close()


TUNING_PROGRESS = TuningProgress()
