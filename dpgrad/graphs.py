"""A whole DP training step captured in one CUDA graph and replayed.

Where the GPU work of a step is small (vision models, GPT-2-sized models, sweeps) the step is
bound by the host: Python, the hooks and the kernel launches. ``graphed_step`` takes the
function that runs one step (forward pass, dpgrad's clipped backward, the DP optimizer's noise
and step) and, after a few eager warm-up steps, captures it once in a CUDA graph
(``torch.cuda.graph``) and replays it for every later batch: one launch for the whole step.

    step = dpgrad.graphed_step(train_step, module=model, optimizer=optimizer)
    for x, y in loader:          # batches of one shape (make_private(physical_batch_size=...))
        loss = step(x, y)        # the first calls run eagerly, then the graph is replayed

What a replay keeps of the eager step:

- the noise: drawn inside the graph from CUDA's default generator (or the optimizer's own
  CUDA generator, registered with the graph), which gives every replay fresh draws;
- the accounting: the optimizer's step hook (the accountant) is called once per replay with
  the noise multiplier and sampling rate of the captured step, so ``get_epsilon`` counts every
  step;
- the finite check: a step whose per-sample norms are not finite still adds nothing to
  ``p.grad`` (decided on the device); such steps are counted on the device and reported, with
  no host wait, at a later call (``FloatingPointError``), or at once by ``raise_if_not_finite``;
- a function that runs the forward pass and clipped backward only (``optimizer=None``): its
  replays add to ``p.grad`` as the eager passes do, and the optimizer steps outside the graph
  (``dpgrad.hf.DPTrainer`` with ``PrivacyArguments(cuda_graph=True)`` replays each physical
  batch so, one graph per batch shape);
- Poisson batches: with ``make_private(physical_batch_size=...)`` every batch has one shape and
  the loss weights of the padding are rewritten in place for each batch; a Poisson batch
  larger than the physical size, whose parts must accumulate before one step, runs eagerly.

What it refuses, with an error naming the fix: inputs of another shape than the captured
ones, a step that waits for the GPU (``.item()``, printing a tensor, a shape read from data),
a step with no optimizer step (unless ``optimizer=None``), ``secure_mode`` noise, adaptive
clipping (its bound is a new tensor every step), ``recheck_independence``, distributed
training, optimizer settings or trainable parameters changed after the capture (a float
learning rate is part of the graph: give the optimizer a tensor learning rate, or call
``reset()`` to capture again), and a model that is not on a CUDA device.

The whole step also runs under ``torch.compile``: dpgrad's hooks, its loss wrapper and
backward, and its optimizer's noise run eagerly (``torch.compiler.disable``; the hooks read
autograd's nodes, which a compiled graph does not have), so the graph breaks at their calls
and nowhere inside them, and what lies between is compiled.
"""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dpgrad.backward import grad_marks
from dpgrad.backward.finite_checks import FiniteReports
from dpgrad.grad_sample_module import GradSampleModule
from dpgrad.loss import DPTensorFastGradientClipping

# Optimizer settings a replay takes from the capture (float hyperparameters are kernel arguments).
_OPTIMIZER_SETTINGS = ("noise_multiplier", "max_grad_norm", "expected_batch_size", "loss_reduction")


def dpgrad_wrapper(module) -> GradSampleModule:
    """The dpgrad wrapper in ``module``: itself, the one a hooks object holds, or the one inside a
    ``torch.compile`` or another wrapper that keeps it as ``.module``."""
    found = module.__dict__.get("_wrapper", module)
    while not isinstance(found, GradSampleModule):
        inner = found.__dict__.get("_modules", {}).get("_orig_mod") if isinstance(found, nn.Module) else None
        inner = inner if inner is not None else getattr(found, "module", None)
        if not isinstance(inner, nn.Module):
            raise TypeError(f"graphed_step needs a model wrapped by dpgrad (dpgrad.opacus.make_private, "
                            f"GradSampleModule(FastGradientClipping) or a hooks object), not a "
                            f"{type(module).__name__}")
        found = inner
    return found


class CudaGraphs:
    """Capture and replay with ``torch.cuda.CUDAGraph`` (one memory pool per graphed step)."""

    def check_device(self, params: List[torch.Tensor]) -> None:
        devices = {p.device for p in params}
        if any(d.type != "cuda" for d in devices):
            raise ValueError(f"graphed_step captures CUDA work, and the model's parameters are on "
                             f"{sorted(str(d) for d in devices)}: move the model to a CUDA device, or "
                             "call the step function itself")

    def check_inputs(self, leaves: list) -> None:
        off = sorted({str(x.device) for x in leaves if isinstance(x, torch.Tensor) and x.device.type != "cuda"})
        if off:
            raise ValueError(f"graphed_step captures CUDA work, and the batch has tensors on {off}: copy it to "
                             "the GPU before the call (x.to('cuda', non_blocking=True)); a copy from host memory "
                             "inside the step cannot be captured")

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def warmup_stream(self):
        """Where the eager warm-up steps run (a side stream, as torch's whole-network capture
        recipe has it)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        return stream

    def run_on(self, stream):
        return torch.cuda.stream(stream)

    def join(self, stream) -> None:
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, fn: Callable[[], Any], generator: Optional[torch.Generator]) -> Tuple[Callable[[], None], Any]:
        """Capture ``fn`` (its work is not run) and return ``(replay, its outputs)``; the noise
        of ``generator``, a CUDA generator other than the default (which torch registers), is
        drawn afresh at each replay."""
        graph = torch.cuda.CUDAGraph()
        if generator is not None and generator.device.type == "cuda" and \
                generator is not torch.cuda.default_generators[generator.device.index or 0]:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph):
            out = fn()
        return graph.replay, out

    def finite_memory(self):
        return torch.empty((), dtype=torch.int32, pin_memory=True)

    def event(self):
        event = torch.cuda.Event()
        event.record()
        return event


GRAPHS = CudaGraphs()


class GraphedStep:
    """One DP training step, captured in a CUDA graph after ``warmup`` eager calls and replayed
    (see the module docstring; made by ``graphed_step``)."""

    def __init__(self, step: Callable, module, optimizer, warmup: int = 2):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be a whole number of eager steps, 1 or more (the autotuner, the "
                             f"independence check and the optimizer's state are set up in them), not {warmup!r}")
        self.step, self.module, self.optimizer, self.warmup = step, module, optimizer, warmup
        self.wrapper = dpgrad_wrapper(module)
        # Without an optimizer (a pass, not a step): the buffers the graph adds the clipped
        # gradients to, one per trainable parameter, bound to p.grad before each replay.
        self._trainable: List[torch.Tensor] = []
        self._grads: List[torch.Tensor] = []
        self.calls = 0  # steps run, eager or replayed
        self.replays = 0  # steps run by a replay of the graph
        self.eager_steps = 0  # steps run eagerly (warm-up, and parts of batches larger than the physical size)
        self._graphs = GRAPHS
        self.reset()

    def reset(self) -> None:
        """Drop the graph: the next call captures the step again (after the optimizer's or the
        model's settings changed). Raises FloatingPointError first if a replay since the last
        report was not finite (waiting for the device to tell)."""
        finite = getattr(self, "_finite", None)
        if finite is not None and finite[2] is not None:
            finite[2].synchronize()
            self._raise_finite()
        self._replay: Optional[Callable[[], None]] = None
        self._static: List[torch.Tensor] = []
        self._outputs = None
        self._accumulating = False  # an eager part of a batch larger than the physical size ran
        self._finite = None  # the device counter of steps withheld as not finite, and its reads

    @property
    def captured(self) -> bool:
        return self._replay is not None

    # ------------------------------------------------------------------ calls
    def __call__(self, *args, **kwargs):
        self._report_finite()
        if self._replay is None and self.calls < self.warmup:
            return self._eager(args, kwargs, warm_up=True)
        skip = self.optimizer is not None and bool(self.optimizer._check_skip_next_step(pop_next=False))
        if skip or self._accumulating:
            # Part of a Poisson batch larger than the physical size: its parts accumulate before
            # one step, which the captured step (one batch, one step) does not do.
            self._accumulating = skip
            return self._eager(args, kwargs, warm_up=False)
        if self._replay is None:
            return self._capture(args, kwargs)
        self._check_inputs(args, kwargs)
        self._check_settings()
        for static, given in zip(self._static, tree_flatten((args, kwargs))[0]):
            if isinstance(given, torch.Tensor):
                static.copy_(given, non_blocking=True)
        self._before_replay()
        self._replay()
        return self._after_replay()

    def _before_replay(self) -> None:
        """A step: the optimizer's queue of skipped steps popped, as its step would. A pass: what
        p.grad holds read as an eager pass reads it (``dpgrad.backward.grad_marks``: added to where
        it is a sum no step took, refused where that is an accumulation that cannot be
        accounted), then bound (``_bind_grads``)."""
        if self.optimizer is not None:
            self.optimizer._check_skip_next_step(pop_next=True)
            return
        path, held, another = self.wrapper._path, 0, True
        if hasattr(path, "another_batch"):  # (per-sample gradients: the optimizer clips them)
            another = path.another_batch()
            held, anew = grad_marks.before_pass(self._trainable, another_batch=another,
                                                accumulation_allowed=path.grad_accumulation_allowed)
            if anew:
                grad_marks.start_anew(self._trainable)
        self._batches = max(1, held + another)
        self._bind_grads()

    def _bind_grads(self) -> None:
        """Each p.grad bound to the buffer the graph adds to, zeroed where the optimizer's step or
        ``zero_grad`` let go of it, holding p.grad's sums where an eager pass made them."""
        zeroed = []
        for p, buffer in zip(self._trainable, self._grads):
            if p.grad is buffer:
                continue
            if p.grad is None:
                zeroed.append(buffer)
            else:
                buffer.copy_(p.grad)
            # Fresh sums: Opacus's optimizer marks those it noised, to refuse them twice.
            buffer.__dict__.pop("_processed", None)
            p.grad = buffer
        if zeroed:
            torch._foreach_zero_(zeroed)

    def _eager(self, args, kwargs, warm_up: bool):
        graphs = self._graphs
        if warm_up:
            graphs.check_device(self._params())
            stream = graphs.warmup_stream()
            with graphs.run_on(stream):
                out = self.step(*args, **kwargs)
            graphs.join(stream)
        else:
            out = self.step(*args, **kwargs)
        self.calls += 1
        self.eager_steps += 1
        return out

    def _after_replay(self):
        for _ in range(self._hooked_steps if self.optimizer is not None else 0):
            if self._hook is not None:
                self._hook(self._stepped)
        if self.optimizer is None:  # what the replayed pass left in p.grad, as an eager pass marks it
            grad_marks.after_pass(self._trainable, self.wrapper._path.param_name, self._batches)
        self.calls += 1
        self.replays += 1
        count, host, _ = self._finite
        host.copy_(count, non_blocking=True)
        self._finite = (count, host, self._graphs.event())
        return self._outputs

    # ------------------------------------------------------------------ capture
    def _params(self) -> List[torch.Tensor]:
        return [p for p in self.wrapper.parameters() if p.requires_grad]

    def _capture(self, args, kwargs):
        optimizer, wrapper, graphs = self.optimizer, self.wrapper, self._graphs
        self._check_capturable()
        graphs.synchronize()
        wrapper.raise_if_not_finite()  # the eager steps' checks, read before the graph hides them
        leaves, spec = tree_flatten((args, kwargs))
        graphs.check_inputs(leaves)
        self._static = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self._spec = spec
        self._signature = _signature(leaves)
        static_args, static_kwargs = _unflatten(self._static, spec)
        self._trainable = self._params()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)  # the gradients made by the graph, in its memory
        else:  # the graph adds to buffers of its own, made here, outside its memory
            self._grads = [torch.empty_like(p) for p in self._trainable]
            self._before_replay()  # read and bound before the capture: its backward adds to them in place
        self._settings = self._current_settings()
        count = torch.zeros((), dtype=torch.int32, device=self._params()[0].device)
        self._hook, recorded = getattr(optimizer, "step_hook", None), []

        def run():
            with self._replayed(count, recorded):
                return tree_map(_reduced, self.step(*static_args, **static_kwargs))

        try:
            self._replay, self._outputs = graphs.capture(run, getattr(optimizer, "generator", None))
        except RuntimeError as error:
            self.reset()
            if "capturing" in str(error) or "capture" in str(error):
                raise RuntimeError(
                    "the DP step could not be captured in a CUDA graph: something in it makes the host "
                    "wait for the GPU or reads a value from it (.item(), float() or printing a tensor, a "
                    "shape taken from data, a CPU tensor built from a GPU one). Keep the step free of "
                    "them (log the returned loss after the call), or run the step eagerly. "
                    f"torch said: {error}") from error
            raise
        if not recorded and optimizer is not None:
            self.reset()
            raise ValueError("the captured step did not step the DP optimizer: call optimizer.step() in the step "
                             "function (a graphed step is one whole training step)")
        self._check_settings(during_capture=True)
        self._stepped, self._hooked_steps = (recorded[0] if recorded else None), len(recorded)
        self._finite = (count, graphs.finite_memory(), None)
        if optimizer is not None:
            self._before_replay()
        else:  # read before the capture already: the first replay is that pass
            self._bind_grads()
        self._replay()
        return self._after_replay()

    @contextlib.contextmanager
    def _replayed(self, count: torch.Tensor, recorded: list):
        """What the captured step's Python does differently from an eager step's, since a replay
        runs none of it: the accountant's hook records what the step tells it (called by
        ``_after_replay`` once per replay instead), finite checks count on the device, and the
        optimizer's queue of skipped steps is left as it was (popped once per replay instead)."""
        optimizer = self.optimizer if self.optimizer is not None else SimpleNamespace()
        hook, queue = getattr(optimizer, "step_hook", None), list(getattr(optimizer, "_step_skip_queue", []))
        optimizer.step_hook = lambda optim: recorded.append(
            SimpleNamespace(noise_multiplier=optim.noise_multiplier,
                            accumulated_iterations=optim.accumulated_iterations))
        FiniteReports.device_count = count
        try:
            yield
        finally:
            FiniteReports.device_count = None
            optimizer.step_hook = hook
            if hasattr(optimizer, "_step_skip_queue"):
                optimizer._step_skip_queue[:] = queue

    def _check_capturable(self) -> None:
        optimizer, wrapper = self.optimizer, self.wrapper
        self._graphs.check_device(self._params())
        refusals = []
        if getattr(optimizer, "secure_mode", False):
            refusals.append("secure_mode draws its noise from a cryptographically secure generator, which a CUDA "
                            "graph cannot replay: turn secure_mode off, or run the step eagerly")
        if hasattr(optimizer, "_adjusted_noise_multiplier"):
            refusals.append("adaptive clipping makes a new bound tensor at every step, which a replay would not "
                            "see: use flat, per-layer or per-block clipping, or run the step eagerly")
        if getattr(wrapper._path, "recheck_independence", None) is not None:
            refusals.append("recheck_independence probes the model from Python every few steps, which a replay "
                            "does not run: leave it None (new layouts are still checked in the eager warm-up)")
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            refusals.append("distributed training (DDP, FSDP2) is not captured yet: run the step eagerly")
        for group in getattr(optimizer, "param_groups", []):
            if group.get("capturable") is False:
                refusals.append(f"{type(getattr(optimizer, 'original_optimizer', optimizer)).__name__} was made "
                                "with capturable=False: pass capturable=True (make_private(cuda_graph=True) does)")
                break
        if refusals:
            raise ValueError("graphed_step cannot capture this DP step: " + "; ".join(refusals))

    def _current_settings(self) -> Dict[str, Any]:
        optimizer = self.optimizer
        if optimizer is None:
            return {}
        found = {name: getattr(optimizer, name, None) for name in _OPTIMIZER_SETTINGS}
        for i, group in enumerate(getattr(optimizer, "param_groups", [])):
            for key, value in group.items():
                if key != "params" and isinstance(value, (int, float, tuple)) and not isinstance(value, bool):
                    found[f"param_groups[{i}][{key!r}]"] = value
        return found

    def _check_settings(self, during_capture: bool = False) -> None:
        if [id(p) for p in self._params()] != [id(p) for p in self._trainable]:
            raise ValueError(
                "the model's trainable parameters changed since the step was captured (requires_grad set "
                "or cleared), and the graph replays the captured ones: call reset() on the graphed step to "
                "capture it again")
        now = self._current_settings()
        changed = [f"{k}: {self._settings[k]!r} -> {now.get(k)!r}" for k in self._settings if now.get(k) != self._settings[k]]
        if changed and during_capture:
            self.reset()
            raise ValueError(
                f"the step function changes the optimizer's settings ({'; '.join(changed)}), and a CUDA graph "
                "replays the captured ones: step a learning-rate schedule outside the graphed step, on an "
                "optimizer whose learning rate is a tensor (lr=torch.tensor(...) with capturable=True)")
        if changed:
            raise ValueError(
                "the optimizer's settings changed since the step was captured, and the graph replays the "
                f"captured ones ({'; '.join(changed)}). Call reset() on the graphed step to capture it again, "
                "or give the optimizer a learning rate it reads from a tensor (lr=torch.tensor(...) with "
                "capturable=True) for a schedule")

    def _check_inputs(self, args, kwargs) -> None:
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self._spec or _signature(leaves) != self._signature:
            raise ValueError(
                f"the step was captured for inputs {_describe(self._signature)} and got "
                f"{_describe(_signature(leaves))}: a CUDA graph replays one shape. Give batches of one "
                "shape (make_private(physical_batch_size=...) pads Poisson batches to one size), or make a "
                "graphed step for each shape")

    # ------------------------------------------------------------------ finite checks
    def _report_finite(self) -> None:
        """Raise for captured steps withheld as not finite, once their count has reached the host
        (never waits)."""
        if self._finite is None or self._finite[2] is None or not self._finite[2].query():
            return
        self._raise_finite()

    def raise_if_not_finite(self) -> None:
        """Raise FloatingPointError now if a step since the last report had non-finite per-sample
        values, waiting for the device to tell (after the last step of a run)."""
        self.wrapper.raise_if_not_finite()
        if self._finite is not None and self._finite[2] is not None:
            self._finite[2].synchronize()
            self._raise_finite()

    def _raise_finite(self) -> None:
        count, host, _ = self._finite
        bad = int(host.item())
        if bad:
            count.zero_()
            host.zero_()
            raise FloatingPointError(
                f"{bad} replayed DP step(s) had non-finite per-sample gradient norms (inf or NaN in the loss, "
                "the inputs or the weights; in reduced precision, an overflow). Those steps added nothing to "
                "p.grad (their clipped gradients were replaced by zeros on the device). Run the step eagerly "
                "to see which parameters, and fix the cause (loss scaling, learning rate, inputs).")


def graphed_step(step: Callable, *, module, optimizer, warmup: int = 2) -> GraphedStep:
    """``step`` (one whole DP training step: forward pass, loss, ``backward()``,
    ``optimizer.step()``, ``optimizer.zero_grad()``) captured in a CUDA graph after ``warmup``
    eager calls, and replayed on every later call.

    Args:
        step: the step function; its tensor arguments are the batch, of one shape for every
            call. It returns tensors (a dpgrad loss is returned reduced, as ``loss.detach()``), or
            nothing. What a replay returns is the graph's own output memory, rewritten by the
            next replay: ``clone()`` what you keep.
        module: the model as dpgrad wrapped it (``make_private``'s, or a hooks object).
        optimizer: the DP optimizer the step steps; or None for a function that runs the forward
            pass and the clipped backward only and leaves the noise and the optimizer's step to
            its caller, eager (several physical batches accumulating before one step, or a
            training loop that steps the optimizer itself, as ``DPTrainer``'s): the graph adds
            the clipped gradients to buffers of its own, bound to ``p.grad`` before each replay
            (zeroed where the optimizer's step or ``zero_grad`` let go of them).
        warmup: eager steps before the capture (at least 1: the autotuner's choices, the
            independence check and the optimizer's state are made in them).

    Returns:
        a ``GraphedStep``: call it as the step function. ``replays``, ``eager_steps`` and
        ``captured`` say what ran; ``reset()`` captures again at the next call;
        ``raise_if_not_finite()`` reports withheld steps at once.
    """
    return GraphedStep(step, module, optimizer, warmup=warmup)


class GraphedPerShape:
    """A ``GraphedStep`` for each shape of inputs ``step`` is called with, made at the first call
    of that shape (its eager warm-up, then its capture). Each graph holds memory of its own:
    a warning names the count past ``MANY_SHAPES`` shapes (pad inputs to fewer)."""

    MANY_SHAPES = 8

    def __init__(self, step: Callable, *, module, optimizer=None, warmup: int = 2):
        self.step, self.module, self.optimizer, self.warmup = step, module, optimizer, warmup
        self.graphs: Dict[str, GraphedStep] = {}

    def __call__(self, *args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        key = f"{spec} {_describe(_signature(leaves))}"
        graphed = self.graphs.get(key)
        if graphed is None:
            graphed = self.graphs[key] = GraphedStep(self.step, self.module, self.optimizer, warmup=self.warmup)
            if len(self.graphs) == self.MANY_SHAPES + 1:
                warnings.warn(f"{len(self.graphs)} input shapes, each captured in a CUDA graph of its own memory: "
                              "pad the inputs to fewer shapes (sequences to a few lengths)", stacklevel=2)
        return graphed(*args, **kwargs)


def _reduced(value):
    """A step's output as the graph keeps it: a dpgrad loss as its reduced value."""
    return value.detach() if isinstance(value, DPTensorFastGradientClipping) else value


def _signature(leaves) -> Tuple:
    return tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else ("value", x)
                 for x in leaves)


def _describe(signature) -> str:
    return ", ".join(f"{list(s[0])} {str(s[1]).replace('torch.', '')}" if s[0] != "value" else repr(s[1])
                     for s in signature)


def _unflatten(leaves, spec):
    return tree_unflatten(leaves, spec)


__all__ = ["GraphedStep", "graphed_step"]
