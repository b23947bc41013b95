"""Per-sample gradients of any layer through ``torch.func`` (vmap of grad).

Used for layers with trainable parameters but no registered grad sampler, and for every
layer under ``force_functorch=True``. The layer's forward is re-run on one sample at a time,
vectorised by vmap, on a parameter-free copy of the layer. A forward vmap cannot batch, one
whose shapes depend on its inputs' values (indexing by a boolean mask, ``.tolist()`` of
counts), is re-run sample by sample in a loop; one that draws random numbers is refused (a
re-run would draw others than the forward pass did).
"""

from __future__ import annotations

import copy
import types
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpgrad.checks.forward_probe import moved_rows
from dpgrad.kernels.backend import first_line, layer_name
from dpgrad.samplers import registry


def _meta_copy(layer: nn.Module) -> nn.Module:
    """A deep copy of ``layer`` whose parameters and buffers live on the meta device (no weight
    copies: the recomputation is given the live ones)."""
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in layer.parameters()
    }
    memo.update({id(b): torch.empty_like(b, device="meta") for b in layer.buffers()})
    clone = copy.deepcopy(layer, memo)
    forward = registry.taken_whole(clone)
    if forward is not None:  # recomputed by its registered forward (registry.register_whole)
        clone.forward = types.MethodType(forward, clone)
    # Hooks of the live layer must not run inside the functional re-computation.
    for m in clone.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    return clone


class Keywords:
    """How a call of a layer taken whole is run again, kept last among its inputs. ``values``:
    its positional inputs that are not tensors but hold some (a tuple of masks), by position,
    and its keyword arguments; ``split``: the positions, among the tensors of ``values`` in
    ``tree_flatten`` order, of those that hold one row per sample along the batch dimension
    (split by sample as the positional tensors are; the others are given whole to every sample);
    ``folded``: the call took the batch's tokens flattened (B*T rows), so each sample's rows are
    given as they were, (T, ...), not with a batch dimension of one; ``moved``: the dimension
    the layer took the batch along in its input and output where not the model's (Gemma 3n's
    decoder layers on (streams, B, T, d)), kept batch first and moved back for the layer (None
    where that could not be told, and the call was taken as the model holds the batch)."""

    __slots__ = ("values", "split", "folded", "outputs", "flat", "moved", "check", "along")

    def __init__(self, kwargs: dict, packed: Optional[dict] = None, split=frozenset(), folded: bool = False,
                 moved: Optional[int] = 0):
        self.values, self.split, self.folded, self.moved = (packed or {}, kwargs), split, folded, moved
        # The positions among ``split`` of tensors that held the batch's tokens flattened where
        # the layer's input is (B, T, ...), kept as (B, T, ...): each sample's rows are given as
        # (T, ...), as they were for a batch of one.
        self.flat = frozenset()
        # The positions, among the output's tensors, of those whose backprops were recorded
        # together (flattened per sample, end to end), or () for the first tensor's alone.
        self.outputs: tuple = ()
        # (the batch's dimension in them, the output tensors recorded) as the forward pass gave
        # them, for the recomputation to be checked against (``Unreproduced``), or None.
        self.check: Optional[tuple] = None
        # The positions among ``split`` of tensors holding the batch along another dimension than
        # the model's (laid out as an input that holds it along ``moved``): that dimension.
        self.along: dict = {}

    def flatten_tokens(self, flat: frozenset, batch: int) -> None:
        """The tensors at ``flat`` (B*T rows) viewed as (B, T, ...), to be split by sample."""
        leaves, spec = tree_flatten(self.values)
        at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        for k in flat:
            t = leaves[at[k]]
            leaves[at[k]] = t.reshape(batch, t.shape[0] // batch, *t.shape[1:])
        self.values, self.flat = tree_unflatten(leaves, spec), flat

    def unfold(self, batch: int, n: int) -> None:
        """Taken as a call on the batch's ``n`` tokens flattened: the keyword tensors of ``n``
        rows viewed as (batch, n // batch, ...) and split by sample."""
        leaves, spec = tree_flatten(self.values)
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        self.split = frozenset(i for i, t in enumerate(tensors) if t.dim() and t.shape[0] == n)
        self.values = tree_unflatten([v.reshape(batch, n // batch, *v.shape[1:])
                                      if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
                                      for v in leaves], spec)
        self.folded = True


def _first_tensor(output):
    """The first tensor of an output: itself, or in a tuple, a list or a mapping (a Hugging
    Face ModelOutput's first field, its last hidden state), searched depth first."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list, dict)):
        for item in (output.values() if isinstance(output, dict) else output):
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


# What ``FunctionalGradients.follow`` leaves as the copy has it: its own parameters on the meta
# device, its submodules, and itself.
_STRUCTURE = frozenset(("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                        "ft_compute_sample_grad"))


class FunctionalGradients:
    """``(params, activations, backprops) -> {name: (B, ...)}``: per-sample gradients of one
    layer through torch.func, on a parameter-free copy of it (so a copy or a pickle of the
    layer takes this along without its weights). ``params`` maps the layer's parameter names to
    tensors; gradients are returned for those that require grad. ``buffers``: the live layer's
    buffers by name, read by the recomputation (the copy's own are as they were when copied)."""

    def __init__(self, layer: nn.Module, batch_first: bool = True):
        self.stateless = _meta_copy(layer)
        # Each sample is fed back with a batch dimension of one, where the layer expects it.
        self.batch_dim = 0 if batch_first else 1

    def follow(self, layer: nn.Module) -> None:
        """Give the copy the live layer's state other than its parameters, buffers, submodules
        and hooks, as it is now (an attribute set after wrapping, train or eval mode): the
        per-sample gradients are those of the forward pass that ran, not of the layer as it was
        when copied."""
        live = list(layer.modules())
        copies = list(self.stateless.modules())
        if len(live) != len(copies):  # submodules changed without a new hooking
            self.stateless = _meta_copy(layer)
            return
        for mine, theirs in zip(copies, live):
            for key, value in theirs.__dict__.items():
                if key not in _STRUCTURE and "hook" not in key:
                    mine.__dict__[key] = value

    def __call__(self, params: Dict[str, torch.Tensor], activations: List, backprops: torch.Tensor,
                 buffers: Optional[Dict[str, torch.Tensor]] = None):
        call = Keywords({})
        if activations and isinstance(activations[-1], Keywords):
            call, activations = activations[-1], activations[:-1]
        names = [n for n, p in params.items() if p.requires_grad]
        # ``.data``, not ``.detach()``: a forward that changes a weight in place (Gemma 3n clamps its
        # coefficients' ``weight.data``) must not bump the live one's version, which a graph kept
        # for a second backward pass (double backward) checks.
        frozen = {**(buffers or {}), **{n: p.data for n, p in params.items() if not p.requires_grad}}
        if backprops.shape[0] == 0:
            # vmap over an empty batch fails in some layers' backward (nn.Embedding's).
            return {n: params[n].new_zeros((0, *params[n].shape)) for n in names}
        stateless, batch_dim = self.stateless, self.batch_dim
        leaves, spec = tree_flatten(call.values)
        tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        split_at = [i for i in tensors if tensors.index(i) in call.split]
        split = [leaves[i] for i in split_at]
        dims = [call.along.get(tensors.index(i), batch_dim) for i in split_at]  # each one's batch
        as_rows = {i for i in tensors if tensors.index(i) in call.flat}  # a sample's (T, ...), no batch of one
        whole = [v if i not in tensors or tensors.index(i) not in call.split else None for i, v in enumerate(leaves)]
        if not call.folded and not call.outputs:
            backprops = _by_sample(backprops, activations)
        if not split and not call.outputs and not any(isinstance(a, torch.Tensor) for a in activations):
            # Given nothing with a row per sample (Perceiver's latents, made for batch_size rows).
            packed, keywords = tree_unflatten(whole, spec)
            inputs = tuple(packed.get(i, a) for i, a in enumerate(activations))
            grads = _by_output_rows(lambda given: functional_call(
                stateless, {**frozen, **dict(zip(names, given))}, inputs, keywords),
                tuple(params[n].data for n in names), backprops, batch_dim)
            return dict(zip(names, grads))

        def one(a):  # a sample's input as the layer takes it
            return a if call.folded else a.unsqueeze(batch_dim)

        checking = call.check is not None and not call.folded  # keep the sample's outputs to compare

        def front(t):  # an output as recorded, its batch (of one) first
            return t.movedim(call.moved, 0) if call.moved else t

        def sample_loss(trainable, acts, rows, bp):
            inputs = tuple(one(a) if isinstance(a, torch.Tensor) else a for a in acts)
            if call.moved:
                inputs = (inputs[0].movedim(0, call.moved), *inputs[1:])
            given = iter(zip(rows, dims))
            packed, keywords = tree_unflatten([_one(*next(given), i in as_rows or call.folded)
                                               if v is None and i in tensors else v for i, v in enumerate(whole)], spec)
            inputs = tuple(packed.get(i, a) for i, a in enumerate(inputs))
            out = functional_call(stateless, {**frozen, **dict(zip(names, trainable))}, inputs, keywords)
            if call.outputs:  # several outputs' backprops, each sample's flattened end to end
                made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                picked = [made[i] for i in call.outputs]
                outs = [front(t).reshape(-1) for t in picked]
                loss = sum((o * piece).sum() for o, piece in zip(outs, bp.split([o.numel() for o in outs])))
            else:
                picked = [_first_tensor(out)]
                loss = (front(picked[0]) * (bp if call.folded else bp.unsqueeze(batch_dim))).sum()
            return loss, tuple(t.detach() for t in picked) if checking else ()

        packed_at = call.values[0]  # positional arguments taken from ``values``, split or whole
        in_dims = (None, tuple(0 if isinstance(a, torch.Tensor) and i not in packed_at else None
                               for i, a in enumerate(activations)),
                   tuple(dims), 0)
        trainable = tuple(params[n].data for n in names)
        args = (trainable, tuple(activations), tuple(split), backprops)
        try:
            grads, made = vmap(grad(sample_loss, has_aux=True), in_dims=in_dims)(*args)
        except RuntimeError as exc:
            if not _data_dependent(exc):
                raise
            grads, made = _sample_by_sample(sample_loss, args, in_dims)
        if checking:
            _check_reproduced(made, *call.check)
        return dict(zip(names, grads))


# What vmap says of a forward whose shapes depend on its inputs' values.
_DYNAMIC = ("dynamic shape", "data-dependent", ".item()", "doesn't have storage")


def _data_dependent(exc: RuntimeError) -> bool:
    return any(s in str(exc) for s in _DYNAMIC)


class RandomDraw(RuntimeError):
    """A forward run again per sample drew random numbers."""


class _NoDraws(TorchDispatchMode):
    """Refuses an operation that draws random numbers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs or {}):
            raise RandomDraw(f"called random operation {func}")
        return func(*args, **(kwargs or {}))


def _draws(func, args, kwargs) -> bool:
    """Whether ``func``, an operation that may draw random numbers, does: not attention or
    dropout with a probability of zero."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in ("dropout_p", "p"):
            value = kwargs.get(arg.name, args[i] if i < len(args) else arg.default_value)
            return value != 0
    return True


def _by_output_rows(forward, trainable: tuple, backprops: torch.Tensor, batch_dim: int) -> tuple:
    """Per-sample gradients of a layer given no tensor with a row per sample, whose output has
    one (``forward(trainable)``, run once): each sample's is the gradient of the output's rows
    with that sample's backprops alone, one backward pass per sample."""
    leaves = tuple(t.detach().requires_grad_() for t in trainable)
    with torch.enable_grad(), _NoDraws():
        out = _first_tensor(forward(leaves))
        per_sample = []
        for b in range(backprops.shape[batch_dim]):
            cotangent = torch.zeros_like(out)
            cotangent.select(batch_dim, b).copy_(backprops.select(batch_dim, b))
            per_sample.append(_grads(out, leaves, cotangent, retain_graph=True))
    return tuple(torch.stack(gs) for gs in zip(*per_sample))


def _sample_by_sample(sample_loss, args, in_dims) -> tuple:
    """``vmap(grad(sample_loss), in_dims)(*args)`` as a loop over the samples, by autograd."""
    trainable, activations, split, backprops = args

    def take(x, dim, b):
        return x if dim is None or not isinstance(x, torch.Tensor) else x.select(dim, b)

    per_sample, made = [], []
    for b in range(backprops.shape[0]):
        leaves = tuple(t.detach().requires_grad_() for t in trainable)
        with torch.enable_grad(), _NoDraws():
            loss, outputs = sample_loss(leaves, tuple(take(a, d, b) for a, d in zip(activations, in_dims[1])),
                                        tuple(take(r, d, b) for r, d in zip(split, in_dims[2])), backprops[b])
            per_sample.append(_grads(loss, leaves))
            made.append(outputs)
    return tuple(torch.stack(gs) for gs in zip(*per_sample)), tuple(torch.stack(o) for o in zip(*made))


def _grads(out: torch.Tensor, leaves: tuple, cotangent: Optional[torch.Tensor] = None, retain_graph=False) -> list:
    """The gradients of ``out`` (times ``cotangent``) with respect to ``leaves``, zeros for those
    it does not reach."""
    got = torch.autograd.grad(out, leaves, cotangent, retain_graph=retain_graph, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves)]


def _one(row: torch.Tensor, dim: int, as_it_is: bool) -> torch.Tensor:
    """A sample's part of a tensor split by sample, as the layer takes it: with a batch of one
    along ``dim``, or ``as_it_is`` (a sample's tokens of a tensor that held them flattened)."""
    return row if as_it_is else row.unsqueeze(dim)


class Unreproduced(ValueError):
    """A layer run again on one sample at a time did not give what the forward pass gave."""


def _check_reproduced(made: tuple, dim: int, outputs: tuple) -> None:
    """Raise ``Unreproduced`` where the recomputation's outputs (``made``: each (B, *one
    sample's output)) move from the forward pass's (``outputs``, the batch along ``dim``) by
    more than the forward probe's tolerance of each sample's norm (one wait for the device).
    An output shared by all samples (no row per sample) is not compared."""
    flags = []
    for got, given in zip(made, outputs):
        expected = given.movedim(dim, 0).unsqueeze(dim + 1) if given.dim() > dim else None
        if expected is not None and expected.shape == got.shape:
            flags.append(moved_rows(expected, got.to(expected.dtype), 0))
    if not flags:
        return
    differ = torch.stack(flags).any(0).nonzero().flatten().tolist()  # the one wait
    if differ:
        raise Unreproduced(differ)


def _by_sample(backprops: torch.Tensor, activations: List) -> torch.Tensor:
    """``backprops`` (batch first, as the activations) by sample: an output whose rows fold each
    sample's (k rows per sample, as a router's ``x.view(-1, d)`` of a (B, T, d) input gives) is
    viewed as (B, k, ...), row i being sample i // k's (the order the independence check verified)."""
    batch = next((a.shape[0] for a in activations if isinstance(a, torch.Tensor) and a.dim()), None)
    rows = backprops.shape[0]
    if batch and rows != batch and rows % batch == 0:
        return backprops.reshape(batch, rows // batch, *backprops.shape[1:])
    return backprops


def prepare_layer(layer: nn.Module, batch_first: bool = True) -> None:
    """Attach ``layer.ft_compute_sample_grad`` (a ``FunctionalGradients``). The layer's buffers
    are read live at each recomputation: constants it uses (a rotary table, a router's bias)."""
    layer.ft_compute_sample_grad = FunctionalGradients(layer, batch_first)


def ft_compute_per_sample_gradient(
    layer: nn.Module, activations: List, backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Grad sampler for any layer: ``{parameter: (B, *parameter.shape)}`` via torch.func."""
    if not hasattr(layer, "ft_compute_sample_grad"):
        prepare_layer(layer)
    params = dict(layer.named_parameters())
    buffers = dict(layer.named_buffers())
    acts = [
        a.to(backprops.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in activations
    ]
    compute = layer.ft_compute_sample_grad
    compute.follow(layer)
    try:
        grads = compute(params, acts, backprops, buffers)
    except torch.OutOfMemoryError:
        raise
    except Unreproduced as exc:
        raise ValueError(
            f"layer {layer_name(layer)} has no per-sample gradient sampler, so torch.func computes its per-sample "
            f"gradients by running its forward again on one sample at a time, and run so it does not give what "
            f"it gave in the forward pass (samples {exc.args[0][:8]}): a tensor given to it was split by sample or "
            "given whole wrongly, most likely a table (positions, a mask shared by all samples) whose first size is "
            "the batch size or the batch's tokens by chance, which a step at another batch size tells apart: run a "
            "first step at another batch size (what it shows is remembered for the layer); or its forward reads "
            "other samples or changes from call to call."
        ) from None
    except RuntimeError as exc:
        if "vmap" not in str(exc) and not isinstance(exc, RandomDraw):
            raise RuntimeError(
                f"layer {layer_name(layer)} has no per-sample gradient sampler, so torch.func computes its "
                f"per-sample gradients by running its forward again on one sample at a time, and that forward "
                f"failed so ({first_line(exc)}). Freeze the layer (requires_grad_(False)) and train the others (or "
                "adapters such as LoRA), or register a grad sampler for its type (dpgrad.register_grad_sampler)."
            ) from exc
        why = ("it draws random numbers (a router's noise, dropout in training), which a second run would draw "
               "anew" if "random" in str(exc) else "it depends on the values of its inputs")
        raise RuntimeError(
            f"layer {layer_name(layer)} has no per-sample gradient sampler, so torch.func computes its "
            f"per-sample gradients by running its forward on one sample at a time, and that forward cannot run "
            f"so ({first_line(exc)}): {why}. Freeze the layer (requires_grad_(False)) and train the others (or "
            "adapters such as LoRA), move its random draws outside it (set its dropout to 0), or register a grad "
            "sampler for its type (dpgrad.register_grad_sampler)."
        ) from exc
    return {params[name]: g for name, g in grads.items()}
