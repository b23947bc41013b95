"""The candidates the autotuner chooses between, per kind of work.

A kind's inputs are the tensors a sampler has in hand:
- ``linear_norm``: (A (B, T, d), G (B, T, p)) -> squared weight norms (B,)
- ``linear_grad_sample``: (A, G) -> per-sample weight gradients (B, p, d)
- ``linear_clipped_sum``: (A, G, coef (B,)) -> the clipped weight gradient ``(c ⊙ G)^T A`` (p, d)
- ``embedding_norm``: (ids (B, T), G (B, T, d), V, padding_idx) -> squared norms (B,)
- ``embedding_grad_sample``: the same inputs -> per-sample gradients (B, V, d)
- ``conv_norm``: (x (B, C_in, *S), G (B, C_out, *out), geometry (``ConvGeometry``)) -> squared
  weight norms (B,): a Linear algorithm on the unfolded input, or the per-sample gradients
Each candidate names its backend ("triton" or "eager", see dpgrad.kernels.backend), runs on those
inputs, and has a cost (tuning/cost_model.py) for its shape. The eager candidates are also
the oracle a candidate's result is checked against before it may win.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from dpgrad.kernels import backend
from dpgrad.kernels import reference

from . import cost_model

KINDS = ("linear_norm", "linear_grad_sample", "linear_clipped_sum", "embedding_norm", "embedding_grad_sample",
         "conv_norm")


@dataclass(frozen=True)
class Shape:
    """What a tuning decision depends on (before bucketing B and T)."""

    kind: str
    B: int
    T: int
    # ("d", 768), ("p", 3072); ("V", ...), ("d", ...); a convolution's per group ("d", C_in/g*K),
    # ("p", C_out/g), ("g", g)
    dims: Tuple[Tuple[str, int], ...]
    dtype: torch.dtype
    device: torch.device

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Candidate:
    """One way to do a kind of work: ``run(*inputs)`` and its ``cost(shape)``."""

    kind: str
    name: str  # e.g. "triton-direct"
    backend: str  # "triton" or "eager"
    algorithm: str  # e.g. "direct", "gram", "segments"
    function: str  # the backend module's function that does the work
    kernel: Optional[str] = None  # "module:attr" of the Triton kernel whose config is reported
    # The kernel's config chosen for a shape ((name, value) pairs), launched directly within
    # ``configured``: a process that finds the choice in the tune store runs no config search.
    config: Optional[Tuple[Tuple[str, Any], ...]] = None

    def ops(self):
        return reference if self.backend == "eager" else backend.triton_ops()

    def run(self, *inputs, **options):
        return getattr(self.ops(), self.function)(*inputs, **options)

    def grouped(self):
        """The Triton form of ``function`` that takes a group of layers of one shape in one
        launch (lists of inputs, one per argument)."""
        return getattr(backend.triton_ops(), f"{self.function}_grouped")

    def with_config(self, config: Optional[Dict[str, Any]]) -> "Candidate":
        """This candidate with ``config`` (``triton_config``'s form) to launch its kernel with."""
        if self.backend != "triton" or self.kernel is None or not config:
            return self
        return dataclasses.replace(self, config=tuple(sorted(config.items())))

    def configured(self):
        """A context in which the kernel launches with ``config`` (no config search), if set."""
        if self.config is None:
            return contextlib.nullcontext()
        from dpgrad.kernels import triton_common

        return triton_common.configured(self._kernel(), dict(self.config))

    def _kernel(self):
        module, attr = self.kernel.split(":")
        return getattr(importlib.import_module(module), attr)

    def cost(self, shape: Shape) -> cost_model.Cost:
        e = shape.element_size
        if self.kind == "linear_norm":
            return cost_model.linear_norm_cost(self.algorithm, self.backend, shape.B, shape.T, shape.dim("d"),
                                               shape.dim("p"), e)
        if self.kind == "linear_grad_sample":
            return cost_model.linear_grad_sample_cost(self.backend, shape.B, shape.T, shape.dim("d"), shape.dim("p"), e)
        if self.kind == "linear_clipped_sum":
            return cost_model.linear_clipped_sum_cost(self.backend, shape.B, shape.T, shape.dim("d"), shape.dim("p"), e)
        if self.kind == "conv_norm":
            return cost_model.conv_norm_cost(self.algorithm, self.backend, shape.B, shape.T, shape.dim("d"),
                                             shape.dim("p"), shape.dim("g"), e, cpu=shape.device.type == "cpu")
        what = "norm" if self.kind == "embedding_norm" else "grad_sample"
        return cost_model.embedding_cost(what, self.backend, shape.B, shape.T, shape.dim("V"), shape.dim("d"), e,
                                         self.algorithm)

    def workspace(self, shape: Shape) -> Optional[float]:
        """Bytes one sample holds at once besides the inputs (a batch slice holds this times its
        samples), for the kinds whose work can be cut into batch slices of any size
        (``conv_norm``, whose functions take ``batch_slice``); None for the others."""
        if self.kind != "conv_norm":
            return None
        return cost_model.conv_norm_workspace(self.algorithm, self.backend, shape.T, shape.dim("d"), shape.dim("p"),
                                              shape.dim("g"), shape.element_size, shape.device.type == "cpu")

    def triton_config(self) -> Optional[Dict[str, Any]]:
        """The block sizes and warps Triton's autotuner last chose for this candidate's kernel."""
        if self.backend != "triton" or self.kernel is None:
            return None
        config = getattr(self._kernel(), "best_config", None)
        if config is None:
            return None
        return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _linear_norm(backend_name: str, algorithm: str, kernel: Optional[str]) -> Candidate:
    return Candidate("linear_norm", f"{backend_name}-{algorithm}", backend_name, algorithm,
                     f"linear_weight_sq_norm_{algorithm}", kernel if backend_name == "triton" else None)


_K = "dpgrad.kernels."
CANDIDATES: Dict[str, List[Candidate]] = {
    "linear_norm": [
        _linear_norm("triton", "direct", _K + "linear_norm_direct:_linear_direct_norm_kernel"),
        _linear_norm("triton", "gram", _K + "linear_norm_gram:_linear_gram_norm_kernel"),
        _linear_norm("triton", "outer", _K + "linear_token_sum:_token_sum_kernel"),
        _linear_norm("eager", "direct", None),
        _linear_norm("eager", "gram", None),
        _linear_norm("eager", "outer", None),
    ],
    "linear_grad_sample": [
        Candidate("linear_grad_sample", "triton-outer-product", "triton", "outer-product", "linear_grad_sample",
                  _K + "linear_grad_sample:_linear_per_sample_kernel"),
        Candidate("linear_grad_sample", "eager-bmm", "eager", "bmm", "linear_grad_sample"),
    ],
    "linear_clipped_sum": [
        Candidate("linear_clipped_sum", "triton-fused", "triton", "fused", "linear_clipped_sum",
                  _K + "linear_clipped_sum:_linear_clipped_sum_kernel"),
        Candidate("linear_clipped_sum", "eager-gemm", "eager", "gemm", "linear_clipped_sum_gemm"),
    ],
    "embedding_norm": [
        Candidate("embedding_norm", "triton-segments", "triton", "segments", "embedding_sq_norm",
                  _K + "embedding_segment_sum:_segment_sum_kernel"),
        Candidate("embedding_norm", "eager-sort", "eager", "sort", "embedding_sq_norm"),
        Candidate("embedding_norm", "eager-gram", "eager", "gram", "embedding_sq_norm_gram"),
    ],
    "embedding_grad_sample": [
        Candidate("embedding_grad_sample", "triton-segments", "triton", "segments", "embedding_grad_sample",
                  _K + "embedding_segment_sum:_segment_sum_kernel"),
        Candidate("embedding_grad_sample", "eager-index-add", "eager", "index-add", "embedding_grad_sample"),
    ],
    "conv_norm": [
        Candidate("conv_norm", "triton-unfold-direct", "triton", "direct", "conv_weight_sq_norm_direct",
                  _K + "linear_norm_direct:_linear_direct_norm_kernel"),
        Candidate("conv_norm", "triton-unfold-gram", "triton", "gram", "conv_weight_sq_norm_gram",
                  _K + "linear_norm_gram:_linear_gram_norm_kernel"),
        Candidate("conv_norm", "eager-unfold-direct", "eager", "direct", "conv_weight_sq_norm_direct"),
        Candidate("conv_norm", "eager-unfold-gram", "eager", "gram", "conv_weight_sq_norm_gram"),
        Candidate("conv_norm", "eager-grad-sample", "eager", "grad-sample", "conv_weight_sq_norm_grad_sample"),
    ],
}


def shape_of(kind: str, inputs: tuple) -> Shape:
    """The Shape of a kind's inputs (see the module docstring for their order)."""
    if kind in ("linear_norm", "linear_grad_sample", "linear_clipped_sum"):
        A, G = inputs[:2]
        B, T, d = A.shape
        return Shape(kind, B, T, (("d", d), ("p", G.shape[-1])), G.dtype, G.device)
    if kind in ("embedding_norm", "embedding_grad_sample"):
        ids, G, V = inputs[:3]
        T = math.prod(ids.shape[1:])
        return Shape(kind, ids.shape[0], T, (("V", V), ("d", G.shape[-1])), G.dtype, G.device)
    if kind == "conv_norm":
        x, G, geom = inputs[:3]
        g = geom.groups
        return Shape(kind, x.shape[0], math.prod(G.shape[2:]),
                     (("d", x.shape[1] // g * geom.positions), ("p", G.shape[1] // g), ("g", g)), G.dtype, G.device)
    raise ValueError(f"unknown tuning kind {kind!r}: one of {', '.join(KINDS)}")


def applicable(kind: str, shape: Shape, tensors: Tuple[torch.Tensor, ...]) -> List[Candidate]:
    """The candidates that may run here: the backends dpgrad.kernels.backend allows for the tensors,
    and the algorithms that apply to the shape ("outer" exactly when T == 1)."""
    allowed = {backend.ops_for(*tensors).NAME}
    if "triton" in allowed and backend.requested() == "auto":
        allowed.add("eager")  # on a GPU the eager form is a candidate too
    out = []
    for cand in CANDIDATES[kind]:
        if cand.backend not in allowed:
            continue
        if kind == "linear_norm" and (cand.algorithm == "outer") != (shape.T == 1):
            continue
        out.append(cand)
    return out

