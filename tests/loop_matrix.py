"""The training loops users write, measured against what DP-SGD promises.

Each loop runs a few logical steps with no noise and SGD at lr 1, recording every physical
batch it runs and the parameters it ran at. The update of each released step is then fitted,
by least squares, to the float64 clipped sums of every physical batch run so far (torch.func
per-sample gradients of a clean twin of the model, each clipped to C by hand): each physical
batch's fitted coefficient is its multiplicity in the update, which must be 1 for the step's
own batches and 0 for every other. The accountant's recorded sample rate is compared with the
rate the loop spent (Poisson: q per step; shuffled batches: q times the loader batches in the
step). A loop is exact when both hold, refused when it raised before releasing anything wrong,
and broken otherwise.

``python tests/loop_matrix.py`` prints the table; tests/test_training_loops.py asserts it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

N_SAMPLES, FEATURES, CLASSES = 24, 6, 3
BOUND = 0.5  # C: most samples' gradients are larger, so the clipping shows in every update


def make_model(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, CLASSES)).to(dtype)


def make_data(dtype=torch.float64) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, FEATURES, generator=gen, dtype=torch.float64)
    x = x * torch.linspace(0.2, 4.0, N_SAMPLES, dtype=torch.float64)[:, None]  # norms from below C to far above
    y = torch.randint(0, CLASSES, (N_SAMPLES,), generator=gen)
    return TensorDataset(x.to(dtype), y)


@dataclasses.dataclass
class Physical:
    """A physical batch as it ran: its samples, their loss weights (0: padding), the
    parameters it ran at, the loader batch it is part of, and whether the loop threw its
    gradient away (``zero_grad()`` before a step took it)."""
    x: torch.Tensor
    y: torch.Tensor
    weights: torch.Tensor
    params: Dict[str, torch.Tensor]
    draw: int
    dropped: bool = False


@dataclasses.dataclass
class Released:
    """A released step: its update and the physical batches run before it."""
    update: torch.Tensor
    batches: int


@dataclasses.dataclass
class Outcome:
    """What a loop did: its physical batches, released steps, recorded sample rates and the
    error that stopped it (None: it ran to the end)."""
    physical: List[Physical]
    released: List[Released]
    recorded_rates: List[float]
    error: Optional[BaseException] = None
    first_rate: float = 0.0  # q: the loader's sample rate (expected batch / N)


class Recorder:
    """Handed to a loop: ``batch(x, y, weights)`` before each physical batch's forward pass,
    ``stepped()`` after each ``optimizer.step()``, ``zeroed()`` after each ``zero_grad()``,
    ``new_draw()`` at each batch the loader yields (a logical draw, for the rate spent)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.physical: List[Physical] = []
        self.released: List[Released] = []
        self._draw = 0
        self._untaken = 0  # physical batches no step() has seen yet
        self._before = self._flat()

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).double() for p in self.model.parameters() if p.requires_grad])

    def batch(self, x, y, weights=None) -> None:
        weights = torch.ones(len(x), dtype=torch.float64) if weights is None else weights.detach().double().cpu()
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.physical.append(Physical(x.detach().clone(), y.detach().clone(), weights, params, self._draw))
        self._untaken += 1

    def new_draw(self) -> None:
        self._draw += 1

    def zeroed(self) -> None:
        for batch in self.physical[len(self.physical) - self._untaken:]:
            batch.dropped = True
        self._untaken = 0

    def stepped(self) -> None:
        self._untaken = 0
        after = self._flat()
        if not torch.equal(after, self._before):
            self.released.append(Released(self._before - after, len(self.physical)))
        self._before = after


def clipped_sum(twin: nn.Module, batch: Physical, bound: float = BOUND) -> torch.Tensor:
    """The batch's float64 clipped sum, flattened: each sample's gradient of its own loss
    (torch.func), clipped to ``bound`` by Opacus's formula, times its loss weight."""
    names = [n for n, p in twin.named_parameters() if p.requires_grad]
    params = {n: batch.params[n].double() for n in names}
    buffers = {n: b.double() for n, b in twin.named_buffers()}

    def loss(p, x, y):
        out = functional_call(twin, {**p, **buffers}, (x[None],))
        return F.cross_entropy(out, y[None])

    if len(batch.x) == 0:
        return torch.zeros(sum(batch.params[n].numel() for n in names), dtype=torch.float64)
    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, batch.x.double(), batch.y)
    flat = torch.cat([grads[n].reshape(len(batch.x), -1) for n in names], dim=1)
    norms = flat.norm(dim=1)
    coef = torch.clamp(bound / (norms + 1e-6), max=1.0) * batch.weights
    return (coef[:, None] * flat).sum(0)


def multiplicities(outcome: Outcome, divisors: List[float]) -> List[Tuple[List[float], float]]:
    """For each released step: the multiplicity of every physical batch run so far in its
    update (fitted coefficient times the step's divisor) and the fit's relative residual."""
    twin = make_model()
    sums = torch.stack([clipped_sum(twin, b) for b in outcome.physical], dim=1) if outcome.physical else None
    rows = []
    for step, divisor in zip(outcome.released, divisors):
        basis = sums[:, :step.batches]
        coef = torch.linalg.lstsq(basis, step.update[:, None]).solution[:, 0]
        residual = (basis @ coef - step.update).norm() / step.update.norm().clamp(min=1e-300)
        rows.append(([float(c) * divisor for c in coef], float(residual)))
    return rows


# ---------------------------------------------------------------------- the loops
# Each takes (model, optimizer, criterion, loader, recorder, steps) and runs ``steps`` logical
# steps. ``criterion(out, y)`` is what the user calls; ``batches`` the loader.

def _zero(optimizer, recorder):
    optimizer.zero_grad()
    recorder.zeroed()


def _run(model, criterion, x, y, recorder, weights=None):
    recorder.batch(x, y, weights)
    criterion(model(x), y).backward()


def loop_plain(model, optimizer, criterion, loader, recorder, steps, zero="before"):
    """zero_grad(); forward; backward; step() per loader batch (``zero="after"``: zero_grad()
    after the step instead)."""
    loop_accumulate(model, optimizer, criterion, loader, recorder, steps, k=1, zero="each" if zero == "before" else zero)


def loop_accumulate(model, optimizer, criterion, loader, recorder, steps, k=2, zero="after"):
    """k loader batches backward before one step(); zero_grad() after the step (``zero="each"``:
    before every backward, which throws the earlier ones away)."""
    taken = 0
    for i, (x, y) in enumerate(loader):
        if taken == steps:
            break
        recorder.new_draw()
        if zero == "each":
            _zero(optimizer, recorder)
        _run(model, criterion, x, y, recorder)
        if (i + 1) % k == 0:
            optimizer.step()
            recorder.stepped()
            taken += 1
            if zero == "after":
                _zero(optimizer, recorder)


def loop_memory_manager(model, optimizer, criterion, loader, recorder, steps, zero="before", size=3):
    """Opacus's BatchMemoryManager: each physical batch backward(); step() (skipped but for
    the last of a logical batch); zero_grad() before each batch, after every step, only after
    a real step, or never."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=size, optimizer=optimizer) as batches:
        _physical_steps(model, optimizer, criterion, batches, recorder, steps, zero)


def _physical_steps(model, optimizer, criterion, batches, recorder, steps, zero, weights_of=None):
    taken, fresh = 0, True
    for x, y in batches:
        if fresh:
            recorder.new_draw()
        if zero == "before":
            _zero(optimizer, recorder)
        _run(model, criterion, x, y, recorder, None if weights_of is None else weights_of())
        optimizer.step()
        real = not optimizer._is_last_step_skipped
        recorder.stepped()
        if zero == "each" or (zero == "real" and real):
            _zero(optimizer, recorder)
        fresh = real
        if real:
            taken += 1
            if taken == steps:
                break


def loop_fixed_shape(model, optimizer, criterion, loader, recorder, steps, zero="before"):
    """make_private(physical_batch_size=...): each physical batch backward(); step()."""
    _physical_steps(model, optimizer, criterion, loader, recorder, steps, zero,
                    weights_of=lambda: (torch.arange(loader.size) < loader.samples).double())


def loop_grad_scaler(model, optimizer, criterion, loader, recorder, steps, zero="before"):
    """torch.amp.GradScaler (on the CPU): scaler.scale(loss).backward(); scaler.step(optimizer);
    scaler.update()."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        recorder.new_draw()
        _zero(optimizer, recorder)
        recorder.batch(x, y)
        scaler.scale(criterion(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        recorder.stepped()


LOOPS: Dict[str, Callable] = {
    "plain": loop_plain,
    "accumulate": loop_accumulate,
    "memory-manager": loop_memory_manager,
    "fixed-shape": loop_fixed_shape,
    "grad-scaler": loop_grad_scaler,
}


@dataclasses.dataclass
class Case:
    """A cell of the matrix: a loop with its options, a wrapper mode and the sampling."""
    loop: str
    mode: str  # "ghost" (two passes), "single" (one pass), "hooks" (per-sample gradients)
    poisson: bool
    options: Dict = dataclasses.field(default_factory=dict)
    own_criterion: bool = False  # the user's nn.CrossEntropyLoss, not the loss make_private returns
    steps: int = 2
    batch_size: int = 6
    dtype: str = "float64"

    @property
    def name(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        crit = " own-criterion" if self.own_criterion else ""
        return f"{self.loop}({opts}){crit} {self.mode} {'poisson' if self.poisson else 'shuffled'}"


def run_case(case: Case) -> Outcome:
    """Run the case through ``dpgrad.opacus.make_private`` with Opacus's PrivacyEngine."""
    from opacus import PrivacyEngine

    import dpgrad.opacus

    torch.manual_seed(2)
    dtype = getattr(torch, case.dtype)
    model = make_model(dtype)
    data = make_data(dtype)
    loader = DataLoader(data, batch_size=case.batch_size, shuffle=not case.poisson)
    engine = PrivacyEngine()
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
                  noise_multiplier=0.0, max_grad_norm=BOUND, poisson_sampling=case.poisson,
                  loss_reduction="sum", criterion=nn.CrossEntropyLoss(reduction="sum"))
    if case.mode == "hooks":
        kwargs["grad_sample_mode"] = "hooks"
        kwargs.pop("criterion")
    else:
        kwargs["single_backward"] = case.mode == "single"
    if case.loop == "fixed-shape":
        kwargs["physical_batch_size"] = case.options.get("size", 4)
    made = dpgrad.opacus.make_private(engine, **kwargs)
    if case.mode == "hooks":
        wrapped, optimizer, loader = made
        criterion = nn.CrossEntropyLoss(reduction="sum")
    else:
        wrapped, optimizer, criterion, loader = made
        if case.own_criterion:
            criterion = nn.CrossEntropyLoss(reduction="sum")
    recorder = Recorder(model)
    q = 1 / len(loader) if case.loop != "fixed-shape" else loader.sample_rate
    error = None
    options = {k: v for k, v in case.options.items() if k != "size"}
    try:
        LOOPS[case.loop](wrapped, optimizer, criterion, loader, recorder, case.steps, **options)
    except Exception as exc:  # noqa: BLE001 - a refusal is an outcome
        error = exc
    rates = [rate for _, rate, n in engine.accountant.history for _ in range(n)]
    return Outcome(recorder.physical, recorder.released, rates, error, q)


def verdict(case: Case, outcome: Outcome) -> Dict:
    """The row of the table for ``case``: multiplicities, rates recorded and spent, verdict."""
    fits = multiplicities(outcome, [1.0] * len(outcome.released))
    # fp32 updates against float64 sums: fp32 rounding over a few dozen terms.
    tol = 1e-6 if case.dtype == "float64" else 1e-4
    exact, shown, spent, first = True, [], [], 0
    for step, (mult, residual) in enumerate(fits):
        own = outcome.physical[first:outcome.released[step].batches]
        want = [0.0] * first + [0.0 if b.dropped else 1.0 for b in own]
        exact &= residual < tol * 1e-2 and all(abs(m - w) < tol for m, w in zip(mult, want))
        shown.append("/".join(f"{m:.2g}" if abs(m - round(m)) > tol else str(int(round(m))) for m in mult[first:])
                     + ("" if all(abs(m) < 1e-6 for m in mult[:first]) else " (+earlier)"))
        draws = len({b.draw for b in own if not b.dropped})
        # Poisson draws summed into one step: no sample rate describes what it released.
        spent.append(outcome.first_rate * max(draws, 1) if not (case.poisson and draws > 1) else math.nan)
        first = outcome.released[step].batches
    rates_ok = len(outcome.recorded_rates) == len(spent) and all(
        abs(a - b) < 1e-12 for a, b in zip(outcome.recorded_rates, spent))
    if not (exact and rates_ok):
        result = "BROKEN"
    elif len(outcome.released) == case.steps:
        result = "exact"
    else:
        result = "refused" if outcome.error is not None else "BROKEN"
    return {"case": case.name, "multiplicities": "; ".join(shown) or "-",
            "recorded": ", ".join(f"{r:.3g}" for r in outcome.recorded_rates) or "-",
            "spent": ", ".join(f"{r:.3g}" for r in spent) or "-", "verdict": result,
            "error": "" if outcome.error is None else f"{type(outcome.error).__name__}: {str(outcome.error)[:120]}"}


def matrix() -> List[Case]:
    """Every cell: the loops, where zero_grad() sits, the modes and the sampling."""
    cases = []
    for mode in ("ghost", "single", "hooks"):
        for poisson in (True, False):
            cases.append(Case("plain", mode, poisson))
            cases.append(Case("plain", mode, poisson, {"zero": "after"}))
            if mode != "hooks":
                cases.append(Case("plain", mode, poisson, own_criterion=True))
            for zero in ("before", "each", "real", "never"):
                cases.append(Case("memory-manager", mode, poisson, {"zero": zero}))
            cases.append(Case("accumulate", mode, poisson))
            cases.append(Case("accumulate", mode, poisson, {"zero": "each"}))
            if mode != "hooks" and poisson:
                cases.append(Case("grad-scaler", mode, poisson, dtype="float32"))
        if mode != "hooks":
            for zero in ("before", "real", "never"):
                cases.append(Case("fixed-shape", mode, True, {"zero": zero}))
    return cases


if __name__ == "__main__":
    import sys

    rows = [verdict(c, run_case(c)) for c in matrix()]
    keys = ["case", "multiplicities", "recorded", "spent", "verdict"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(r[k] for k in keys) + " |")
    for r in rows:
        if r["error"]:
            print(f"{r['case']}: {r['error']}", file=sys.stderr)


# ---------------------------------------------------------------------- DPTrainer
def lm_clipped_sum(model: nn.Module, params: Dict[str, torch.Tensor], rows: List[dict], bound: float) -> torch.Tensor:
    """The float64 clipped sum of causal-LM ``rows`` (DPTrainer's loss: each row's mean token
    cross-entropy, labels -100 ignored) at ``params``, flattened over the trainable parameters."""
    twin = copy.deepcopy(model).double()
    names = [n for n, p in twin.named_parameters() if p.requires_grad]
    values = {n: params[n].double() for n in names}

    def loss(p, ids, mask, labels):
        logits = functional_call(twin, p, args=(), kwargs=dict(
            input_ids=ids[None], attention_mask=mask[None], position_ids=torch.arange(len(ids))[None])).logits
        return F.cross_entropy(logits[0, :-1], labels[1:], ignore_index=-100)

    flat = []
    for row in rows:
        g = grad(loss)(values, row["input_ids"], row["attention_mask"], row["labels"])
        flat.append(torch.cat([g[n].reshape(-1) for n in names]))
    if not flat:
        return torch.zeros(sum(values[n].numel() for n in names), dtype=torch.float64)
    flat = torch.stack(flat)
    coef = torch.clamp(bound / (flat.norm(dim=1) + 1e-6), max=1.0)
    return (coef[:, None] * flat).sum(0)


def fit(update: torch.Tensor, sums: List[torch.Tensor]) -> Tuple[List[float], float]:
    """Each sum's coefficient in ``update`` (least squares) and the fit's relative residual."""
    basis = torch.stack(sums, dim=1)
    coef = torch.linalg.lstsq(basis, update[:, None].double()).solution[:, 0]
    return [float(c) for c in coef], float((basis @ coef - update).norm() / update.norm())
