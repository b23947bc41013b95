"""The autotuner: candidates, cost model, timing and the persistent per-device store.

Samplers ask ``get_tuner().select(kind, inputs, layer)`` for the candidate to run; see
tuner.py for how it decides and ``DPGRAD_TUNE`` / ``DPGRAD_TUNE_DIR`` for the controls.
"""

from .candidates import CANDIDATES, KINDS, Candidate, Shape
from .store import TuneStore
from .timing import Decision, measure_ms
from .tuner import Recording, Tuner, bucket, get_tuner, tune_mode

__all__ = ["CANDIDATES", "KINDS", "Candidate", "Decision", "Recording", "Shape", "TuneStore", "Tuner", "bucket",
           "get_tuner", "measure_ms", "tune_mode"]
