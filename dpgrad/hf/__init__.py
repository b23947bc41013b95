"""Private fine-tuning with the Hugging Face ``Trainer``: ``DPTrainer`` (``trainer``), its
settings ``PrivacyArguments`` (``privacy``) and its Poisson sampler (``sampling``).

``transformers`` is imported with ``DPTrainer`` only, at its first use: the settings and the
sampler do not need it.
"""

from dpgrad.hf.privacy import PrivacyArguments
from dpgrad.hf.sampling import LogicalBatch, PoissonSampler


def __getattr__(name):
    if name == "DPTrainer":
        from dpgrad.hf.trainer import DPTrainer

        return DPTrainer
    raise AttributeError(f"module 'dpgrad.hf' has no attribute {name!r}")


__all__ = ["PrivacyArguments", "DPTrainer", "PoissonSampler", "LogicalBatch"]
