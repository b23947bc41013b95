"""Samplers for ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2's projections).

Inputs of any rank (B, *, d) are flattened to (B, T, d) (a view when the strides allow it,
else one copy); 2-D inputs have T = 1. The autotuner (dpgrad.tuning) picks the kernel per
layer shape among those ``dpgrad.kernels.backend`` allows: Triton for CUDA tensors, eager otherwise.

``transformers.pytorch_utils.Conv1D`` computes ``x @ W + b`` with W stored (d, p), the
transpose of a Linear's: its per-sample weight gradient ``A_b^T G_b`` is a Linear's with the
roles of A and G swapped, its norm a Linear's. It is registered by dotted path (dpgrad never
imports transformers).

Under autocast a layer multiplies its input cast to the autocast dtype, which autograd saves
for the weight's gradient, and not the input itself (fp32, often a tensor nothing else keeps):
the hooks keep autograd's cast (``linear_kept_inputs``), half the bytes, and the samplers read
half-precision operands on both sides, the same values they would round the input to.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpgrad.samplers import registry
from dpgrad.kernels.backend import guarded, ops_for
from dpgrad.kernels import reference
from dpgrad.kernels.reference import accumulation_dtype, same_layout
from dpgrad.backward.layer_inputs import saved_operand
from dpgrad.samplers.registry import (
    CALLED_BY_NAME,
    FUNCTIONAL_CALLS,
    SIGNATURES,
    register_clipped_sum_sampler,
    register_factor_sampler,
    register_grad_sample_group,
    register_grad_sampler,
    register_kept_inputs,
    register_norm_group,
    register_norm_sampler,
)
from dpgrad.samplers.groups import (Coefficients, Group, cat, clipped_sums_of, row_norms, stackable, trainable,
                                    weights_then_biases)
from dpgrad.tuning import get_tuner

CONV1D = "transformers.pytorch_utils.Conv1D"
LAYERS = [nn.Linear, CONV1D]


# A subclass of nn.Linear whose forward calls F.linear on its weight (through super().forward,
# doing more around it: Phi-MoE's and Llama 4's routers) is hooked at those calls; one that
# computes its output otherwise is taken whole by torch.func.
FUNCTIONAL_CALLS[nn.Linear] = F.linear
CALLED_BY_NAME.add(nn.Linear)


def _linear(input, weight, bias=None):
    """F.linear's signature (a builtin's, which inspect cannot read)."""


SIGNATURES[F.linear] = _linear


def flatten_tokens(activations: torch.Tensor, backprops: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, *, d) inputs and (B, *, p) backprops -> (B, T, d) and (B, T, p)."""
    if activations.dim() == 3 and backprops.dim() == 3:
        return activations, backprops
    B = backprops.shape[0]
    T = math.prod(backprops.shape[1:-1])
    A = activations.reshape(B, T, activations.shape[-1])
    G = backprops.reshape(B, T, backprops.shape[-1])
    return A, G


# The nodes a Linear's or Conv1D's output comes from: a view of one product of the input (B*T, d).
_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")
_SAVED_INPUT = {"AddmmBackward0": "_saved_mat1", "MmBackward0": "_saved_self"}


@register_kept_inputs(LAYERS)
def linear_kept_inputs(layer: nn.Module, inputs, output: torch.Tensor) -> list:
    """What the hooks keep of a call under autocast whose input x was cast for the product:
    the cast, as autograd saved it for the weight's gradient (a view, no copy), shaped as x.
    Elsewhere, or where that tensor cannot be read as it is (saved-tensor hooks in force, a
    forward that is not one product, the samplers in force not these), the inputs."""
    kept = list(inputs)
    x = kept[0] if len(kept) == 1 else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return kept
    device = x.device.type
    if not torch.is_autocast_enabled(device) or x.dtype == torch.get_autocast_dtype(device):
        return kept
    if not registry.served_by(type(layer), __name__):
        return kept
    node = output.grad_fn
    if type(node).__name__ in _VIEWS:
        node = node.next_functions[0][0]
    attr = _SAVED_INPUT.get(type(node).__name__)
    saved = None if attr is None else saved_operand(node, attr)  # the product's first operand: the input
    d = x.shape[-1]
    if saved is None or saved.dtype != torch.get_autocast_dtype(device) or saved.shape != (x.numel() // max(d, 1), d):
        return kept
    try:
        return [saved.view(x.shape)]
    except RuntimeError:  # not viewable so: the inputs, as before
        return kept


def _transposed(layer: nn.Module) -> bool:
    """Whether the weight is stored (d, p), as Conv1D's is, rather than a Linear's (p, d)."""
    return not isinstance(layer, nn.Linear)


@register_grad_sampler(LAYERS)
def linear_grad_sample(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients in the parameters' dtypes: weight (B, *weight.shape), bias (B, p)."""
    A, G = flatten_tokens(activations[0], backprops)
    weight, bias = trainable(layer)
    out = {}
    if weight:
        # Conv1D's (d, p) weight: the same product with the roles of A and G swapped; a
        # Linear's bias comes out of the same pass.
        transposed = _transposed(layer)
        fused = bias and not transposed

        def per_sample(cand):
            return cand.ops().linear_per_sample(*((G, A) if transposed else (A, G)), bias=fused,
                                                out_dtype=layer.weight.dtype)

        res = get_tuner().call("linear_grad_sample", (A, G), layer, per_sample)
        out[layer.weight] = res.weight
        if fused:
            out[layer.bias] = res.bias.to(layer.bias.dtype)
            return out
    if bias:
        out[layer.bias] = guarded("bias gradients", layer, (A, G),
                                  lambda ops: ops.linear_bias_grad_sample(G)).to(layer.bias.dtype)
    return out


@register_norm_sampler(LAYERS)
def linear_norm_sample(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient L2 norms, (B,) each, without per-sample gradients: ``LinearGroup``'s
    for this one layer (the weight's by the candidate the autotuner picked for the shape, the
    bias's ``||sum_t g_t||``)."""
    params, norms = LinearGroup([(layer, activations, backprops)]).norms()
    return dict(zip(params, norms))


@register_clipped_sum_sampler(LAYERS)
def linear_clipped_sum(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor, coef: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Clipped gradients, ``(c ⊙ G)^T A`` (transposed for Conv1D) and ``sum_b c_b sum_t
    G_b[t]`` (p,), in the parameters' dtypes, accumulated in fp32; coef: (B,)."""
    return dict(LinearGroup([(layer, activations, backprops)]).clipped_sums(Coefficients(coef)))


@register_factor_sampler(LAYERS)
def linear_factors(
    layer: nn.Module, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, Tuple[torch.Tensor, torch.Tensor]]:
    """The per-sample gradients as sums of outer products: weight ``sum_t G[t] ⊗ A[t]``
    (``A[t] ⊗ G[t]`` for Conv1D), bias ``sum_t G[t] ⊗ 1``."""
    A, G = flatten_tokens(activations[0], backprops)
    weight, bias = trainable(layer)
    out = {}
    if weight:
        out[layer.weight] = (A, G) if _transposed(layer) else (G, A)
    if bias:
        out[layer.bias] = (G, G.new_ones(1, 1, 1).expand(G.shape[0], G.shape[1], 1))
    return out


@register_norm_group(LAYERS)
class LinearGroup(Group):
    """Linear (or Conv1D) layers whose inputs and backprops have the same shapes and dtypes.

    On the eager backend small ones are concatenated along the batch: one product for all
    their weight norms, one batched product for all their clipped sums. Otherwise the work is
    what the autotuner chose for the shape (chosen once per group): a Triton kernel takes all
    the group's layers in one launch, reading each layer's tensors where they are (a table of
    their addresses), so the launches of a step grow with the distinct layer shapes, not with
    the layers; a GEMM of the library runs layer by layer. The bias gradients are the token
    sums ``sum_t G_b[t]``, taken once in fp32 for both their norms and their clipped sums,
    never a GEMM.
    """

    mixed_clip_groups = True  # each layer clipped with its own group's coefficients

    @classmethod
    def key(cls, layer, activations, backprops):
        x = activations[0]
        return (_transposed(layer), *trainable(layer), x.shape, x.dtype, backprops.shape, backprops.dtype,
                layer.weight.dtype, x.device)

    def __init__(self, records):
        super().__init__(records)
        self._layers = [layer for layer, _, _ in records]
        self._inputs = [flatten_tokens(activations[0], backprops) for _, activations, backprops in records]
        self.records = []
        A0, G0 = self._inputs[0]
        self._ops = ops_for(A0, G0)
        self._bias_sums: Optional[torch.Tensor] = None  # (L*B, p) fp32

    def _stack(self, eager: bool) -> None:
        """Concatenate the layers' inputs along the batch when that is one eager operation."""
        if eager and self._ops is reference and stackable([g for _, g in self._inputs]) and stackable(
                [a for a, _ in self._inputs]):
            self._inputs = [(cat([a for a, _ in self._inputs]), cat([g for _, g in self._inputs]))]

    def _params(self) -> List[nn.Parameter]:
        return weights_then_biases(self._layers)

    def _take_bias_sums(self) -> Optional[torch.Tensor]:
        if self._bias_sums is None and trainable(self._layers[0])[1]:
            Gs = [G for _, G in self._inputs]
            acc = accumulation_dtype(Gs[0])

            def token_sums(ops):
                # Triton: one launch for the group's layers; eager: a sum per layer.
                if ops is reference or len(Gs) == 1 or not same_layout(Gs):
                    return cat([G.sum(dim=1, dtype=acc) for G in Gs])
                return ops.linear_bias_grad_sample_grouped(Gs, out_dtype=acc)

            self._bias_sums = guarded("bias gradients", self._layers[0], (Gs[0],), token_sums)
        return self._bias_sums

    def _run(self, kind: str, cand, inputs: list, grouped: Callable, by_layer: Callable):
        """The group's work of ``kind`` with the chosen candidate: ``grouped(candidate)``, one
        launch for all the layers, where the candidate is a Triton kernel and the layers'
        tensors share a layout; else ``by_layer(candidate)``. Through the tuner: a failing
        Triton launch is done again by the eager candidate, for good."""
        def work(chosen):
            if chosen.backend == "triton" and len(inputs) > 1 and all(same_layout(t) for t in zip(*inputs)):
                return grouped(chosen)
            return by_layer(chosen)

        return get_tuner().run(kind, cand, inputs[0], self._layers[0], work)

    def norms(self):
        weight, _ = trainable(self._layers[0])
        rows = []
        if weight:
            tuner = get_tuner()
            cand = tuner.select_group("linear_norm", self._inputs, self._layers)
            self._stack(cand.backend == "eager")
            inputs = self._inputs

            def by_layer(chosen):
                if chosen.backend == "eager":  # the norms themselves: few operations a layer
                    return reference.linear_weight_norms(inputs, chosen.algorithm)
                return cat([chosen.run(A, G) for A, G in inputs]).sqrt()

            if len(inputs) == 1 and cand.backend == "eager":
                rows.append(by_layer(cand))
            else:
                rows.append(self._run(
                    "linear_norm", cand, inputs,
                    lambda chosen: chosen.grouped()([A for A, _ in inputs], [G for _, G in inputs]).sqrt(), by_layer))
        else:
            self._stack(True)
        bias_sums = self._take_bias_sums()
        if bias_sums is not None:
            rows.append(torch.linalg.vector_norm(bias_sums, dim=1))
        return self._params(), rows

    def clipped_sums(self, coef):
        layers, inputs = self._layers, self._inputs
        weight, bias = trainable(layers[0])
        bias_sums = self._take_bias_sums()
        self._inputs = []
        out = []
        biases = [layer.bias for layer in layers] if bias else []
        if weight:
            weights = [layer.weight for layer in layers]
            weight_sums, bias_from_weights = self._weight_sums(inputs, coef, weights, biases)
            out += zip(weights, weight_sums)
            if bias_from_weights is not None:
                out += zip(biases, bias_from_weights)
                biases = []
        if biases:
            out += clipped_sums_of(biases, coef, bias_sums)
        self._bias_sums = None
        return out

    def _weight_sums(self, inputs, coef, weights, biases) -> Tuple[List[torch.Tensor], Optional[List[torch.Tensor]]]:
        """The clipped sums of the layers' ``weights``, each with its own clipping group's
        coefficients (layers of one shape in several groups are summed together too), and of
        their ``biases`` where they come from the same scaled backprops (else None)."""
        layers = self._layers
        transposed = _transposed(layers[0])
        dtype = layers[0].weight.dtype
        if len(inputs) == 1 and len(layers) > 1:  # stacked: one batched product
            A, G = inputs[0]
            L, d, p = len(layers), A.shape[2], G.shape[2]
            acc = accumulation_dtype(A, G)
            A3 = reference.autocast_rounded(A.view(L, -1, d), G, acc)
            # Each layer's samples scaled by its row of coefficients, on each of their positions.
            scaled = (reference.autocast_rounded(G, A, acc) * coef.sample_rows(weights, G)).view(L, -1, p)
            sums = torch.bmm(A3.mT, scaled) if transposed else torch.bmm(scaled.mT, A3)
            # The biases' sums from the same scaled backprops, where they share the coefficients.
            bias_sums = scaled.sum(1).to(biases[0].dtype).unbind(0) if biases and coef.shared(weights, biases) \
                else None
            return sums.to(dtype).unbind(0), bias_sums
        G0 = inputs[0][1]
        factors = coef.layer_rows(weights, G0)  # (L, B) fp32, as the kernels take them
        each = coef.each(weights, G0)
        cand = get_tuner().select_group("linear_clipped_sum", [(A, G, f) for (A, G), f in zip(inputs, each)], layers)
        # Conv1D's (d, p) weight: the same sums with the roles of A and G swapped.
        lefts, rights = ([G for _, G in inputs], [A for A, _ in inputs]) if transposed else (
            [A for A, _ in inputs], [G for _, G in inputs])

        def by_layer(chosen):
            # Eager: a GEMM on operands scaled in their own dtype.
            scales = [coef.of([w]).rounded_column(G0) for w in weights] if chosen.backend == "eager" else each
            return [chosen.run(left, right, scale, out_dtype=dtype)[0]
                    for left, right, scale in zip(lefts, rights, scales)]

        return self._run("linear_clipped_sum", cand, [(A, G, f) for (A, G), f in zip(inputs, each)],
                         lambda chosen: [w for w, _ in chosen.grouped()(lefts, rights, factors, out_dtype=dtype)],
                         by_layer), None


@register_grad_sample_group(LAYERS)
class LinearGradSampleGroup(LinearGroup):
    """Linear (or Conv1D) layers clipped from their per-sample gradients, kept in fp32: those
    whose per-sample gradients are small (LoRA adapters, for which they are far smaller than
    the inputs and backprops book-keeping would keep), or all of them without ghost clipping.
    The norms come with the gradients (one pass); the clipped sums are ``coef @ g``, a small
    product. Eager: small groups in one batched product; Triton: one launch for the group."""

    def norms(self):
        weight, _ = trainable(self._layers[0])
        transposed = _transposed(self._layers[0])
        rows, self._grads = [], None
        if weight:
            tuner = get_tuner()
            cand = tuner.select_group("linear_grad_sample", self._inputs, self._layers)
            self._stack(cand.backend == "eager")
            # Conv1D's (d, p) weight: the same product with the roles of A and G swapped. The
            # eager product leaves the fp32 gradients' norms to one reduction; Triton's kernel
            # takes them from its accumulators in the same pass.
            inputs = self._inputs
            lefts, rights = ([G for _, G in inputs], [A for A, _ in inputs]) if transposed else (
                [A for A, _ in inputs], [G for _, G in inputs])
            acc = accumulation_dtype(*inputs[0])

            def grouped(chosen):
                res = chosen.ops().linear_per_sample_grouped(lefts, rights, norm=True, out_dtype=acc)
                return res.weight, res.weight_sq_norm.sqrt()

            def by_layer(chosen):
                eager = chosen.backend == "eager"
                res = [chosen.ops().linear_per_sample(left, right, norm=not eager, out_dtype=acc)
                       for left, right in zip(lefts, rights)]
                grads = cat([r.weight for r in res])
                return grads, row_norms(grads) if eager else cat([r.weight_sq_norm for r in res]).sqrt()

            self._grads, norms = self._run("linear_grad_sample", cand, inputs, grouped, by_layer)
            rows.append(norms)
        else:
            self._stack(True)
        bias_sums = self._take_bias_sums()
        if bias_sums is not None:
            rows.append(torch.linalg.vector_norm(bias_sums, dim=1))
        self._inputs = []  # what the clipped sums need is in the gradients now
        return self._params(), rows

    def _weight_sums(self, inputs, coef, weights, biases):
        w, self._grads = self._grads, None
        return [s for _, s in clipped_sums_of(weights, coef, w)], None
