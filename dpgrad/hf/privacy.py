"""``DPTrainer``'s privacy settings (``PrivacyArguments``, which ``transformers.HfArgumentParser``
reads) and the privacy state it saves with each checkpoint (``dpgrad.hf``): its file name, its
format, and what makes a loaded one unsound."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from dpgrad.clipping.coefficients import clipping_bound
from dpgrad.checks.independence_check import check_every

ACCOUNTANTS = ("prv", "rdp")
# The privacy state saved with each checkpoint (one file per process).
PRIVACY_STATE = "dpgrad_privacy"
PRIVACY_FORMAT = "dpgrad-privacy/1"


def privacy_state_problem(state) -> Optional[str]:
    """What in a loaded privacy state is missing or ill-typed; None if nothing."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not isinstance(state, dict) or state.get("format") != PRIVACY_FORMAT:
        return f"not a DPTrainer privacy state (format {PRIVACY_FORMAT!r})"
    if state.get("accountant") not in ACCOUNTANTS:
        return f"accountant {state.get('accountant')!r}, not one of {', '.join(ACCOUNTANTS)}"
    history = state.get("history")
    if not isinstance(history, list) or not all(
            isinstance(h, list) and len(h) == 3 and number(h[0]) and h[0] >= 0 and number(h[1]) and 0 < h[1] <= 1
            and isinstance(h[2], int) and not isinstance(h[2], bool) and h[2] > 0 for h in history):
        return "a 'history' that is not a list of [noise_multiplier, sample_rate, steps]"
    for key in ("noise_multiplier", "sample_rate", "target_delta", "max_grad_norm"):
        if not number(state.get(key)):
            return f"{key} {state.get(key)!r}, not a number"
    # Recorded since resuming with another budget or unit of privacy is refused; absent from
    # the checkpoints saved before.
    if state.get("target_epsilon") is not None and not number(state["target_epsilon"]):
        return f"target_epsilon {state['target_epsilon']!r}, not a number"
    if not isinstance(state.get("user_column"), (str, type(None))):
        return f"user_column {state['user_column']!r}, not a column name"
    if not isinstance(state.get("world_size"), int) or not isinstance(state.get("generator"), str):
        return "no world_size or generator state"
    return None


@dataclass
class PrivacyArguments:
    """The privacy settings of ``DPTrainer`` (``transformers.HfArgumentParser`` reads them).

    Exactly one of ``target_epsilon`` and ``noise_multiplier``; ``target_delta`` defaults to
    N^-1.1 (N rows, or users with ``user_column``), and a given one of 1 / N or more is warned
    of."""

    target_epsilon: Optional[float] = field(default=None, metadata={
        "help": "Privacy budget: the noise is chosen so that the planned steps spend exactly it, "
                "and training stops before a step that would spend more."})
    noise_multiplier: Optional[float] = field(default=None, metadata={
        "help": "Noise standard deviation over max_grad_norm (instead of target_epsilon)."})
    target_delta: Optional[float] = field(default=None, metadata={
        "help": "delta; default N^-1.1 for N rows (or users); a warning at 1 / N or more."})
    max_grad_norm: float = field(default=1.0, metadata={
        "help": "Per-sample clipping bound C (per user with user_column)."})
    accountant: str = field(default="prv", metadata={"help": "Opacus accountant: 'prv' or 'rdp'."})
    single_backward: bool = field(default=True, metadata={
        "help": "One backward pass per physical batch (dpgrad's single backward)."})
    physical_batch_size: Optional[int] = field(default=None, metadata={
        "help": "Rows per forward/backward pass (memory); default per_device_train_batch_size."})
    check_independence: bool = field(default=True, metadata={
        "help": "Verify on the first step that each row's outputs and loss are its own (no mixing "
                "across the batch); False gives up that check."})
    recheck_independence: Optional[int] = field(default=None, metadata={
        "help": "Also verify it every this many physical batches, whatever the model's layout "
                "(a model whose mixing depends on the data); default: new layouts only."})
    cuda_graph: bool = field(default=False, metadata={
        "help": "Replay each physical batch's forward pass and clipped backward from a CUDA graph, "
                "captured after two eager passes (one graph per batch shape: pad sequences to few "
                "lengths); the noise and the optimizer's step run once per step, eagerly."})
    user_column: Optional[str] = field(default=None, metadata={
        "help": "Column of the dataset holding each row's user id: user-level privacy (users are "
                "sampled, and a user moves the gradient by at most max_grad_norm)."})

    def __post_init__(self):
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("PrivacyArguments takes exactly one of target_epsilon and noise_multiplier, "
                             f"not target_epsilon={self.target_epsilon}, noise_multiplier={self.noise_multiplier}")
        if self.target_epsilon is not None and not (math.isfinite(self.target_epsilon) and self.target_epsilon > 0):
            raise ValueError(f"target_epsilon must be a finite positive number, not {self.target_epsilon}")
        if self.noise_multiplier is not None and not (math.isfinite(self.noise_multiplier)
                                                      and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, not {self.noise_multiplier}")
        if self.target_delta is not None and not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta must lie strictly between 0 and 1, not {self.target_delta}")
        self.max_grad_norm = clipping_bound(self.max_grad_norm)
        check_every(self.recheck_independence)
        if self.cuda_graph and self.user_column is not None:
            raise ValueError("cuda_graph=True with user_column: each row's bound is read from the batch on the "
                             "host, which a CUDA graph cannot replay; leave cuda_graph False for user-level privacy")
        if self.cuda_graph and self.recheck_independence is not None:
            raise ValueError("cuda_graph=True with recheck_independence: the recheck probes the model from Python "
                             "every few batches, which a replay does not run; leave recheck_independence None (new "
                             "layouts are still checked, in the eager passes before the capture)")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant={self.accountant!r}: use one of {', '.join(ACCOUNTANTS)}")
        size = self.physical_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"physical_batch_size must be a positive integer, not {size!r}")
