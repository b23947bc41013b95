"""Per-layer and group-wise clipping (``clipping="per_layer"`` / ``"groups"``) in the ghost-clipping
wrapper, both modes: each group's per-sample norms equal the float64 reference's (fp32 rel 1e-5),
and ``p.grad`` is ``sum_b c_{b,g(p)} g_b`` with ``c_{b,g} = min(1, C_g / (norm_{b,g} + 1e-6))``,
on models mixing every supported layer, tied weights and a batch of one; the refusals."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import dpgrad
import dpgrad.opacus
from dpgrad.clipping.groups import even_split, per_block, total_bound
from mixed_net import FREEZES, NetConfig, build, clipped_from_norms, make_batch, per_sample_loss
from per_sample_reference import BACKEND_PASS, assert_norms_close, assert_tensor_close, per_sample_grads
from test_single_backward import TiedClassifier

MODES = ["single", "double"]
# The Triton pass (the interpreter, slow on a CPU) takes the kernels through fewer models.
FREEZES_RUN = ["none"] if BACKEND_PASS else ["none", "layer"]
# Net's parameters by layer: a rule on names (per "block": the part before the first dot).
LAYER_RULE = staticmethod(lambda name: name.split(".")[0])


# When single backward clips the groups whose records are all in (``dpgrad.backward.group_flush``): each
# as soon as it is complete ("eager": a CPU, whose memory torch does not count, with records of
# a large model's size), all at the end
# of the pass ("deferred": a GPU whose backward pass has freed more than the records hold,
# memory in use never above its peak), or at every other completion ("alternate").
FLUSHES = ["eager", "deferred", "alternate"]


@pytest.fixture
def flush(request, monkeypatch):
    """GroupFlush's reading of memory in use, as the parametrised pattern says."""
    from dpgrad.backward import group_flush
    from dpgrad.backward.group_flush import GroupFlush

    if request.param == "eager":
        monkeypatch.setattr(group_flush, "UNCOUNTED_SERVE_BYTES", 0)
        return request.param
    readings = iter(range(1 << 30))

    def memory_in_use(device, peak=False):
        if request.param == "deferred":
            return 0
        return next(readings) % 2  # 0 at the pass's first record (its mark), then 1, 0, 1, ...

    monkeypatch.setattr(GroupFlush, "memory_in_use", staticmethod(memory_in_use))
    return request.param


def wrap(model, mode, clipping, bounds, groups=None, loss_reduction="sum"):
    return dpgrad.GradSampleModuleFastGradientClipping(
        model, loss_reduction=loss_reduction, max_grad_norm=bounds, single_backward=mode == "single",
        clipping=clipping, clipping_groups=groups)


def criterion(wrapped, loss_reduction):
    return dpgrad.DPLossFastGradientClipping(wrapped, SimpleNamespace(loss_reduction=loss_reduction),
                                             nn.CrossEntropyLoss(reduction=loss_reduction), loss_reduction)


def reference_groups(model, clipping, groups):
    """{parameter name: group index} as the specification says, independently of dpgrad."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if clipping == "per_layer":
        return {n: i for i, n in enumerate(names)}
    if callable(groups):
        labels = list(dict.fromkeys(groups(n) for n in names))
        return {n: labels.index(groups(n)) for n in names}
    ids = {id(p): n for n, p in model.named_parameters()}
    return {ids[id(p)]: g for g, ps in enumerate(groups) for p in ps if p.requires_grad}


def group_norms(ref, group_of, G):
    squares = torch.zeros(G, next(iter(ref.values())).shape[0], dtype=torch.float64)
    for n, g in ref.items():
        squares[group_of[n]] += g.flatten(1).square().sum(1)
    return squares.sqrt()


def middle_bounds(model, batch, clipping, groups) -> list:
    """Each group's bound between its middle reference norms: about half its samples clipped."""
    ref = per_sample_grads(model, *batch, per_sample_loss)
    group_of = reference_groups(model, clipping, groups)
    first = group_norms(ref, group_of, max(group_of.values()) + 1).sort(dim=1).values
    middle = first.shape[1] // 2
    return [max(float(first[g, max(middle - 1, 0)] + first[g, middle]) / 2, 1e-3) for g in range(first.shape[0])]


def check(model, batches, mode, clipping, groups=None, loss_reduction="sum", wrapped=None, between=None):
    """Clip ``batches`` (accumulated) through the wrapper (``wrapped``, or one made here with
    ``middle_bounds``); every group's norms and every ``p.grad`` against the float64
    reference; ``between(wrapper)`` is called between each forward and its backward pass.
    Returns the wrapper."""
    refs = [per_sample_grads(model, x, y, per_sample_loss) for x, y in batches]
    group_of = reference_groups(model, clipping, groups)
    G = max(group_of.values()) + 1
    bounds = wrapped.max_grad_norms if wrapped is not None else middle_bounds(model, batches[0], clipping, groups)
    if wrapped is None:
        copied = copy.deepcopy(model)
        if groups is not None and not callable(groups):  # the same parameters, of the copy
            names, mine = {id(p): n for n, p in model.named_parameters()}, dict(copied.named_parameters())
            groups = [[mine[names[id(p)]] for p in ps] for ps in groups]
        wrapped = wrap(copied, mode, clipping, bounds, groups, loss_reduction)
    assert wrapped.max_grad_norms == pytest.approx(bounds) and wrapped.max_grad_norm == pytest.approx(
        math.sqrt(sum(b * b for b in bounds)))
    loss_fn = criterion(wrapped, loss_reduction)
    expected = {n: 0 for n in refs[0]}
    scale = {n: 0.0 for n in refs[0]}
    C = torch.tensor(bounds, dtype=torch.float64)[:, None]
    for (x, y), ref in zip(batches, refs):
        loss = loss_fn(wrapped(x), y)
        if between is not None:
            between(wrapped)
        loss.backward()
        norms = wrapped.per_sample_group_norms
        assert norms.shape == (G, x.shape[0])
        want = group_norms(ref, group_of, G)
        for g in range(G):
            assert_norms_close(norms[g], want[g], f"group {g} norms ({mode})")
        coef = (C / (norms.double() + 1e-6)).clamp(max=1.0)
        assert (coef < 1).any() and (coef == 1).any()
        for n, g in ref.items():
            c = coef[group_of[n]]
            expected[n] = expected[n] + torch.einsum("b,b...->...", c, g)
            scale[n] += (c[:, None] * g.flatten(1).abs()).sum(0).max().item()
    for n, p in wrapped._module.named_parameters():
        if n not in expected:
            assert p.grad is None, n
            continue
        got = torch.zeros_like(p) if p.grad is None else p.grad
        assert_tensor_close(got, torch.zeros_like(p, dtype=torch.float64) + expected[n], f"clipped {n}.grad",
                            scale[n])
    return wrapped


def layer_lists(model):
    """Net's parameters as lists by layer (a list of lists of parameters)."""
    groups = {}
    for n, p in model.named_parameters():
        groups.setdefault(n.split(".")[0], []).append(p)
    return list(groups.values())


SPECS = {
    "per_layer": ("per_layer", None),
    "lists": ("groups", layer_lists),
    "rule": ("groups", lambda model: LAYER_RULE.__func__),
}


@pytest.mark.parametrize("flush", FLUSHES, indirect=True)
@pytest.mark.parametrize("policy", ["", "-norms"])
@pytest.mark.parametrize("freeze", FREEZES_RUN)
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("mode", MODES)
def test_group_norms_and_clipped_sums_match_float64(mode, spec, freeze, policy, flush):
    cfg = NetConfig()
    model = build(cfg, seed=0, freeze=FREEZES[freeze])
    clipping, make = SPECS[spec]
    groups = make(model) if make is not None else None
    batches = [make_batch(cfg, B=6, T=3, seed=10), make_batch(cfg, B=4, T=3, seed=11)]
    if policy:
        with clipped_from_norms():
            check(model, batches, mode, clipping, groups)
    else:
        check(model, batches, mode, clipping, groups)


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", MODES)
def test_mean_reduction_and_a_batch_of_one(mode, loss_reduction):
    cfg = NetConfig()
    model = build(cfg, seed=1)
    check(model, [make_batch(cfg, B=5, T=3, seed=12)], mode, "per_layer", loss_reduction=loss_reduction)
    # A batch of one is clipped from its plain gradient, each parameter by its own group.
    one = [make_batch(cfg, B=1, T=3, seed=13), make_batch(cfg, B=1, T=3, seed=14)]
    group_of = reference_groups(model, "per_layer", None)
    norms = group_norms(per_sample_grads(model, *one[0], per_sample_loss), group_of, len(group_of))[:, 0]
    bounds = [float(n) * (0.5 if g % 2 else 2.0) for g, n in enumerate(norms)]  # every other one clipped
    wrapped = wrap(copy.deepcopy(model), mode, "per_layer", bounds, loss_reduction=loss_reduction)
    check(model, one, mode, "per_layer", loss_reduction=loss_reduction, wrapped=wrapped)


@pytest.mark.parametrize("mode", MODES + ["single-norms"])
def test_tied_weights_share_their_group(mode):
    """The tied embedding/output weight is one parameter: its group's norm includes both uses
    (and their cross term, clipped from norms)."""
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    batches = []
    for B in (5, 3):
        ids = torch.randint(0, 9, (B, 4), generator=g)
        batches.append((ids, torch.randint(0, 9, (B,), generator=g)))
    model = TiedClassifier()
    rule = lambda name: "emb" if name.startswith(("emb", "out.weight")) else "rest"  # noqa: E731
    if mode.endswith("-norms"):
        with clipped_from_norms():
            check(model, batches, "single", "groups", rule)
    else:
        check(model, batches, mode, "groups", rule)
        check(model, batches, mode, "per_layer")


class Blocks(nn.Module):
    """Embedding -> three blocks of one shape (Linear, LayerNorm) -> mean -> output layer: layers
    of one shape in different groups, which the finish step batches by shape."""

    def __init__(self, V: int = 9, d: int = 6, c: int = 4):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d)) for _ in range(3))
        self.head = nn.Linear(d, c)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x.mean(1))


@pytest.mark.parametrize("flush", FLUSHES, indirect=True)
@pytest.mark.parametrize("policy", ["", "-norms"])
@pytest.mark.parametrize("clipping", ["per_block", "per_layer"])
@pytest.mark.parametrize("mode", MODES)
def test_layers_of_one_shape_in_different_groups(mode, clipping, policy, flush):
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(8)
    batches = [(torch.randint(0, 9, (B, 5), generator=g), torch.randint(0, 4, (B,), generator=g)) for B in (6, 4)]
    model = Blocks()
    args = ("groups", per_block) if clipping == "per_block" else ("per_layer",)
    assert len(set(per_block(n) for n, _ in model.named_parameters())) == 4
    if policy:
        with clipped_from_norms():
            check(model, batches, mode, *args)
    else:
        check(model, batches, mode, *args)


@pytest.mark.skipif(BACKEND_PASS, reason="which records are held does not depend on the kernels")
@pytest.mark.parametrize("clipping, peak", [("flat", 8), ("per_block", 3), ("per_layer", 1)])
def test_a_group_is_clipped_as_soon_as_its_records_are_in(clipping, peak, monkeypatch):
    """Single backward keeps a pass's records (each layer's inputs and backprops) until their
    clipping group is complete, then clips it and lets them go (on a CPU, with records of a
    large model's size: with clipping groups every byte counts): Blocks' 8 records (the output
    layer, three blocks of a Linear and a LayerNorm, the embedding) are held all at once under
    flat clipping; per block, at most the output layer's (its group, "other", waits for the
    embedding) and one block's; per layer, one at a time."""
    from dpgrad.backward import group_flush

    if clipping != "flat":
        monkeypatch.setattr(group_flush, "UNCOUNTED_SERVE_BYTES", 0)
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randint(0, 9, (5, 4), generator=g), torch.randint(0, 4, (5,), generator=g)
    model = Blocks()
    n = sum(1 for _ in model.parameters())
    args = {"flat": dict(max_grad_norm=1.0), "per_layer": dict(clipping="per_layer", max_grad_norm=[1.0] * n),
            "per_block": dict(clipping="groups", clipping_groups=per_block, max_grad_norm=[1.0] * 4)}[clipping]
    with clipped_from_norms():
        wrapped = dpgrad.GradSampleModuleFastGradientClipping(model, loss_reduction="sum", single_backward=True,
                                                              **args)
        criterion(wrapped, "sum")(wrapped(x), y).backward()
        assert wrapped._path.records_peak == peak
        # A backward pass that failed (a parameter frozen after the forward pass) leaves no
        # count of its forward pass's calls behind: the next pass clips as early.
        loss = criterion(wrapped, "sum")(wrapped(x), y)
        model.head.bias.requires_grad_(False)
        with pytest.raises(RuntimeError, match="changed requires_grad"):
            loss.backward()
        model.head.bias.requires_grad_(True)
        criterion(wrapped, "sum")(wrapped(x), y).backward()
        assert wrapped._path.records_peak == peak
        # Nor does a forward pass whose backward never comes (an evaluation outside no_grad),
        # once its output is dropped; while it is alive, its calls may still be backpropagated.
        kept = wrapped(x)
        criterion(wrapped, "sum")(wrapped(x), y).backward()
        assert wrapped._path.records_peak == 8
        del kept
        wrapped(x)
        criterion(wrapped, "sum")(wrapped(x), y).backward()
        assert wrapped._path.records_peak == peak


@pytest.mark.skipif(BACKEND_PASS, reason="which records are held does not depend on the kernels")
@pytest.mark.parametrize("readings, peak", [((0, 0, 0, 0, 0), 8), ((0, 1, 0, 1, 0), 5), ((5, 6, 6, 6, 6), 3),
                                            ((1 << 30, 0), 8), ((0, None, None, None, None), 3)],
                         ids=["never-above", "every-other", "always-above", "room", "not-counted"])
def test_complete_groups_wait_while_memory_in_use_is_below_the_mark(readings, peak, monkeypatch):
    """On a GPU a complete group's records are kept while memory in use is at most the most
    the device had held when the pass's first record came (the forward pass's peak; the
    backward pass frees activations as it goes), and every group set aside is clipped at once
    when it is above: Blocks per block (its four groups complete at the last block, then each
    block, then the rest with the embedding), the peak read at the first record and memory in
    use at a completion whose records, with those set aside since the last reading, hold more
    than the room below the mark that reading found. Never above:
    all 8 records held, as under flat clipping; above at the first and third completions: at
    most the output layer, the second block and the first block (5); always above: each group
    as it completes (3); a gigabyte of room at the first completion: read no more; memory in
    use no longer counted after the first record: as on a CPU with records of a large model's
    size (each group as it completes). Exact each time."""
    from dpgrad.backward import group_flush
    from dpgrad.backward.group_flush import GroupFlush

    monkeypatch.setattr(group_flush, "UNCOUNTED_SERVE_BYTES", 0)

    calls, asked = iter(readings), []

    def memory_in_use(device, peak=False):
        asked.append(peak)
        return next(calls)

    monkeypatch.setattr(GroupFlush, "memory_in_use", staticmethod(memory_in_use))
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(9)
    batch = (torch.randint(0, 9, (6, 4), generator=g), torch.randint(0, 4, (6,), generator=g))
    wrapped = check(Blocks(), [batch], "single", "groups", per_block)
    assert wrapped._path.records_peak == peak
    assert next(calls, None) is None  # read as often as the docstring says, no more
    assert asked == [True] + [False] * (len(readings) - 1)  # the peak for the mark, then memory in use


class WithUnusedLayer(Blocks):
    """A layer called whose output reaches no loss: its group is never complete in the pass."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(6, 6)

    def forward(self, ids):
        self.unused(self.emb(ids))
        return super().forward(ids)


@pytest.mark.parametrize("clipping", ["per_block", "per_layer"])
def test_a_group_never_complete_is_clipped_at_the_end_of_the_pass(clipping):
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(10)
    batches = [(torch.randint(0, 9, (5, 4), generator=g), torch.randint(0, 4, (5,), generator=g))]
    args = ("groups", per_block) if clipping == "per_block" else ("per_layer",)
    check(WithUnusedLayer(), batches, "single", *args)


@pytest.mark.parametrize("clipping", ["per_block", "per_layer"])
@pytest.mark.parametrize("mode", MODES)
def test_zero_grad_between_forward_and_backward_keeps_each_group_whole(mode, clipping):
    """``zero_grad()`` after the forward pass (the order ``loss = ...; zero_grad(); backward()``)
    leaves what the wrapper knows of the pass alone: each group is clipped once, whole."""
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randint(0, 9, (6, 5), generator=g), torch.randint(0, 4, (6,), generator=g))]
    args = ("groups", per_block) if clipping == "per_block" else ("per_layer",)
    check(Blocks(), batches, mode, *args, between=lambda wrapped: wrapped.zero_grad())


@pytest.mark.parametrize("flush", FLUSHES, indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_crossed_groups_of_layers_of_one_shape(mode, flush):
    """Two Linear layers of one shape whose weight and bias are in crossed groups (the first
    block's weight with the second's bias, and the reverse): summed apart, each exact."""
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(12)
    batches = [(torch.randint(0, 9, (6, 5), generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(2)]
    model = Blocks()
    first, second = model.blocks[0][0], model.blocks[1][0]
    crossed = [[first.weight, second.bias], [first.bias, second.weight]]
    rest = [p for p in model.parameters() if all(p is not q for ps in crossed for q in ps)]
    with clipped_from_norms():
        check(model, batches, mode, "groups", crossed + [rest])


def test_per_block_rule_and_even_split():
    assert per_block("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert per_block("model.layers.11.mlp.up_proj.lora_A.default.weight") == "model.layers.11"
    assert per_block("transformer.wte.weight") == "other" and per_block("lm_head.weight") == "other"
    assert even_split(2.0, 4) == [1.0] * 4 and total_bound(even_split(3.0, 7)) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="groups must be a positive integer"):
        even_split(1.0, 0)


def _params(model):
    return dict(model.named_parameters())


@pytest.mark.parametrize("case, message", [
    ("flat_list", "flat clipping takes one max_grad_norm, not a list"),
    ("one_number", "takes one max_grad_norm per group"),
    ("count", "6 max_grad_norm values for 7 trainable parameters"),
    ("negative", r"max_grad_norm\[2\] must be a finite positive number"),
    ("missing", r"trainable parameters \['head.weight', 'head.bias'\] are in no clipping group"),
    ("twice", "parameter 'lin1.weight' is in clipping groups 0 and 1"),
    ("foreign", r"holds a parameter of shape \(3,\) that is not the model.s"),
    ("not_a_parameter", r"clipping_groups\[0\] holds a int, not a parameter of the model"),
    ("a_module", r"clipping_groups\[1\] is a Linear: clipping_groups takes lists of parameters"),
    ("a_dict", "clipping_groups takes a list of lists of parameters .* not a dict"),
    ("tied_apart", "parameter 'emb.weight' is tied to 'out.weight', and the rule puts them in different groups"),
    ("groups_without_groups", "clipping='groups' needs clipping_groups"),
    ("groups_with_flat", "clipping_groups needs clipping='groups'"),
    ("unknown", "clipping='adaptive': use one of flat, per_layer, groups"),
])
def test_refusals(case, message):
    cfg = NetConfig(norm1=None, norm2=None, affine=False, gated=False)
    model = build(cfg, seed=0)
    p = _params(model)
    n = len(p)
    kw = dict(clipping="per_layer", max_grad_norm=[1.0] * n)
    if case == "flat_list":
        kw = dict(max_grad_norm=[1.0] * n)
    elif case == "one_number":
        kw["max_grad_norm"] = 1.0
    elif case == "count":
        kw["max_grad_norm"] = [1.0] * (n - 1)
    elif case == "negative":
        kw["max_grad_norm"] = [1.0, 1.0, -1.0] + [1.0] * (n - 3)
    elif case == "missing":
        kw = dict(clipping="groups", max_grad_norm=[1.0], clipping_groups=[[v for k, v in p.items() if "head" not in k]])
    elif case == "twice":
        kw = dict(clipping="groups", max_grad_norm=[1.0, 1.0], clipping_groups=[list(p.values()), [p["lin1.weight"]]])
    elif case == "foreign":
        kw = dict(clipping="groups", max_grad_norm=[1.0], clipping_groups=[[*p.values(), nn.Parameter(torch.ones(3))]])
    elif case == "not_a_parameter":
        kw = dict(clipping="groups", max_grad_norm=[1.0], clipping_groups=[[*p.values(), 3]])
    elif case == "a_module":
        kw = dict(clipping="groups", max_grad_norm=[1.0, 1.0], clipping_groups=[list(p.values()), model.lin1])
    elif case == "a_dict":
        kw = dict(clipping="groups", max_grad_norm=[1.0], clipping_groups={"all": list(p.values())})
    elif case == "tied_apart":
        model = TiedClassifier()
        kw = dict(clipping="groups", max_grad_norm=[1.0, 1.0], clipping_groups=lambda name: name.split(".")[0])
    elif case == "groups_without_groups":
        kw = dict(clipping="groups", max_grad_norm=[1.0])
    elif case == "groups_with_flat":
        kw = dict(max_grad_norm=1.0, clipping_groups=[list(p.values())])
    elif case == "unknown":
        kw = dict(clipping="adaptive", max_grad_norm=[1.0])
    with pytest.raises(ValueError, match=message):
        dpgrad.GradSampleModuleFastGradientClipping(model, single_backward=True, **kw)


def test_a_listed_frozen_parameter_trained_later_is_clipped_with_its_group():
    cfg = NetConfig()
    model = build(cfg, seed=0, freeze=FREEZES["bias"])
    batches = [make_batch(cfg, B=6, T=3, seed=16)]
    copied = copy.deepcopy(model)
    for m in (model, copied):  # lin2.bias made trainable: in its layer's group, listed while frozen
        dict(m.named_parameters())["lin2.bias"].requires_grad_(True)
    bounds = middle_bounds(model, batches[0], "groups", LAYER_RULE.__func__)
    dict(copied.named_parameters())["lin2.bias"].requires_grad_(False)
    wrapped = wrap(copied, "single", "groups", bounds, layer_lists(copied))
    dict(copied.named_parameters())["lin2.bias"].requires_grad_(True)
    check(model, batches, "single", "groups", LAYER_RULE.__func__, wrapped=wrapped)
    assert dict(copied.named_parameters())["lin2.bias"].grad is not None


def test_what_groups_cannot_do_is_refused():
    cfg = NetConfig()
    model = build(cfg, seed=0, freeze=FREEZES["bias"])
    unwrapped = copy.deepcopy(model)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    wrapped = wrap(model, "single", "per_layer", [1.0] * sum(p.requires_grad for p in model.parameters()))
    x, y = make_batch(cfg, B=4, T=3, seed=1)
    losses = per_sample_loss(wrapped(x), y)
    with pytest.raises(ValueError, match="per-sample bounds .* are for flat clipping"):
        wrapped.clipped_backward(losses, max_grad_norms=[0.5] * 4)
    with pytest.raises(RuntimeError, match="one coefficient per sample and group"):
        wrapped.get_clipping_coef()
    with pytest.raises(ValueError, match="max_grad_norm is the total"):
        wrapped.max_grad_norm = 2.0
    # A plain backward, in either mode: groups are clipped in one pass, which Opacus's loss cannot.
    for mode in MODES:
        plain = wrap(copy.deepcopy(unwrapped), mode, "per_layer", wrapped.max_grad_norms)
        with pytest.raises(RuntimeError, match="clips by groups, in one backward pass.*cannot clip by groups"):
            per_sample_loss(plain(x), y).sum().backward()
    # A parameter made trainable after wrapping is in no group: refused before p.grad is touched.
    dict(wrapped._module.named_parameters())[frozen[0]].requires_grad_(True)
    losses = per_sample_loss(wrapped(x), y)
    with pytest.raises(ValueError, match=f"trainable parameter '{frozen[0]}' is in no clipping group"):
        wrapped.clipped_backward(losses)
    assert all(p.grad is None for p in wrapped._module.parameters())
    # So is a layer added after wrapping, named as the model has it now.
    dict(wrapped._module.named_parameters())[frozen[0]].requires_grad_(False)
    wrapped._module.head = nn.Linear(cfg.k * cfg.r, cfg.c)
    losses = per_sample_loss(wrapped(x), y)
    with pytest.raises(ValueError, match="trainable parameter 'head.weight' is in no clipping group"):
        wrapped.clipped_backward(losses)
    assert all(p.grad is None for p in wrapped._module.parameters())


# ---------------------------------------------------------------------- make_private
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("mode", ["ghost-single", "ghost-double", "hooks"])
def test_make_private_per_layer_takes_the_per_parameter_clipped_step(mode, frozen):
    """make_private(clipping="per_layer", max_grad_norm=[one per trainable optimizer parameter],
    as Opacus counts them: a frozen one in the optimizer has none): the step is the
    per-parameter clipped sum over the expected batch size (noise 0), under ghost clipping
    (clipped in the backward pass) and hooks (Opacus's per-layer optimizer)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    cfg = NetConfig()
    model = build(cfg, seed=2)
    if frozen:
        model.lin1.bias.requires_grad_(False)
    start = copy.deepcopy(model)
    x, y = make_batch(cfg, B=6, T=3, seed=15)
    ref = per_sample_grads(model, x, y, per_sample_loss)
    names = list(ref)
    norms = {n: g.flatten(1).norm(dim=1) for n, g in ref.items()}
    bounds = [float(norms[n].median()) for n in names]  # about half of each parameter's samples clipped
    ghost = mode.startswith("ghost")
    out = dpgrad.opacus.make_private(
        PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=0.0, max_grad_norm=bounds,
        clipping="per_layer", poisson_sampling=False, grad_sample_mode="ghost" if ghost else "hooks",
        single_backward=mode == "ghost-single", criterion=nn.CrossEntropyLoss())
    wrapped, optimizer = out[0], out[1]
    assert optimizer.max_grad_norm == pytest.approx(total_bound(bounds), rel=1e-6)
    optimizer.zero_grad()
    logits = wrapped(x)
    if ghost:
        out[2](logits, y).backward()
    else:
        nn.functional.cross_entropy(logits, y).backward()
    optimizer.step()
    now, before = dict(model.named_parameters()), dict(start.named_parameters())
    assert len(names) == len(before) - frozen
    for n, C in zip(names, bounds):
        coef = (C / (norms[n] + 1e-6)).clamp(max=1.0)
        want = before[n].detach().double() - torch.einsum("b,b...->...", coef, ref[n]) / 6
        assert_tensor_close(now[n].detach(), want, f"{n} after the step ({mode})")
    if frozen:
        assert torch.equal(now["lin1.bias"], before["lin1.bias"])


def test_make_private_per_layer_noise_is_scaled_to_the_total_bound():
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x, y = torch.randn(4, 200), torch.randint(0, 100, (4,))
    steps = {}
    for sigma in (0.0, 3.0):
        torch.manual_seed(1)
        model = nn.Linear(200, 100)
        wrapped, optimizer, criterion, _ = dpgrad.opacus.make_private(
            PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=sigma,
            max_grad_norm=[0.3, 0.4], clipping="per_layer", poisson_sampling=False, single_backward=True,
            criterion=nn.CrossEntropyLoss())
        optimizer.zero_grad()
        criterion(wrapped(x), y).backward()
        optimizer.step()
        steps[sigma] = torch.cat([p.detach().flatten() for p in model.parameters()])
    noise = (steps[3.0] - steps[0.0]) * 4  # lr 1, expected batch 4
    assert noise.std().item() == pytest.approx(3.0 * 0.5, rel=0.03)  # sqrt(0.3^2 + 0.4^2) = 0.5


@pytest.mark.parametrize("mode", MODES)
def test_make_private_groups_takes_the_per_group_clipped_step_and_noise_for_the_total(mode):
    """make_private(clipping="groups", clipping_groups=rule, max_grad_norm=[one per group]): the
    step is each group's clipped sum over the expected batch size (noise 0); the optimizer's
    noise is scaled to sqrt(sum C_g^2)."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    cfg = NetConfig()
    model = build(cfg, seed=3)
    start = copy.deepcopy(model)
    x, y = make_batch(cfg, B=6, T=3, seed=16)
    ref = per_sample_grads(model, x, y, per_sample_loss)
    group_of = reference_groups(model, "groups", LAYER_RULE)
    G = max(group_of.values()) + 1
    bounds = middle_bounds(model, (x, y), "groups", LAYER_RULE)
    wrapped, optimizer, loss, _ = dpgrad.opacus.make_private(
        PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=0.0, max_grad_norm=bounds,
        clipping="groups", clipping_groups=LAYER_RULE, poisson_sampling=False, single_backward=mode == "single",
        criterion=nn.CrossEntropyLoss())
    assert G >= 3 and optimizer.max_grad_norm == pytest.approx(total_bound(bounds), rel=1e-6)
    optimizer.zero_grad()
    loss(wrapped(x), y).backward()
    optimizer.step()
    norms = group_norms(ref, group_of, G)
    now, before = dict(model.named_parameters()), dict(start.named_parameters())
    for n, g in ref.items():
        coef = (bounds[group_of[n]] / (norms[group_of[n]] + 1e-6)).clamp(max=1.0)
        want = before[n].detach().double() - torch.einsum("b,b...->...", coef, g) / 6
        assert_tensor_close(now[n].detach(), want, f"{n} after the step ({mode})")


@pytest.mark.parametrize("kw, message", [
    (dict(clipping="groups", max_grad_norm=[1.0, 1.0]), "clipping='groups' needs clipping_groups"),
    (dict(clipping_groups=per_block, max_grad_norm=1.0), "clipping_groups needs clipping='groups'"),
    (dict(clipping="groups", clipping_groups=per_block, max_grad_norm=1.0), "one max_grad_norm per group"),
    (dict(clipping="groups", clipping_groups=per_block, max_grad_norm=[1.0], grad_sample_mode="hooks"),
     "clipping='groups' clips in the backward pass: it needs grad_sample_mode='ghost'"),
    (dict(clipping="groups", clipping_groups=per_block, max_grad_norm=[1.0, 1.0]),
     "2 max_grad_norm values for 1 groups"),
    (dict(clipping="groups", clipping_groups=per_block, max_grad_norm=[float("nan")]),
     r"max_grad_norm\[0\]"),
    (dict(clipping="per_layer", max_grad_norm=1.0), "one max_grad_norm per trainable parameter of the optimizer"),
    (dict(clipping="per_layer", max_grad_norm=[1.0]), r"one max_grad_norm per trainable parameter of the optimizer \(2\)"),
    (dict(max_grad_norm=[1.0, 1.0]), "flat clipping takes one max_grad_norm, not a list"),
    (dict(clipping="median", max_grad_norm=1.0), "clipping='median' is not supported"),
])
def test_make_private_refusals(kw, message):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=message):
        dpgrad.opacus.make_private(
            PrivacyEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.randn(4, 3)), batch_size=2), noise_multiplier=1.0, **kw)


# ---------------------------------------------------------------------- Hugging Face models
@pytest.mark.parametrize("name, dtype", [("gpt2", torch.float32), ("gpt2", torch.bfloat16), ("llama_lora", torch.float32),
                                         ("gpt2_checkpointed", torch.float32)],
                         ids=["gpt2", "gpt2-bf16", "llama_lora", "gpt2-checkpointed"])
@pytest.mark.parametrize("flush", ["eager", "deferred"], indirect=True)
@pytest.mark.parametrize("mode", MODES[:1] if BACKEND_PASS else MODES)
def test_hugging_face_models_per_block(mode, name, dtype, flush):
    """GPT-2 (its tied embedding and output layer in one group, "other") and Llama with LoRA
    adapters (only they train), one group per block, against the float64 one-sample-at-a-time
    reference of tests/test_hf_models.py (bf16 weights: norms within bf16's rel 1e-2; not the
    LoRA model in bf16, whose first block's adapters get norms 1.1% off float64 from plain
    autograd in bf16 itself, a group's norm having no other groups to average its rounding)."""
    import test_hf_models as H

    # Non-reentrant activation checkpointing: the blocks recomputed in the backward pass.
    case = H.gpt2_checkpointed(use_reentrant=False) if name == "gpt2_checkpointed" else H.CASES[name]()
    case.model.to(dtype)
    # Two blocks, and the rest (nothing else trains under LoRA).
    per_block_step(case, mode, 1e-5 if dtype == torch.float32 else H.BF16_RTOL, 2 if name == "llama_lora" else 3)


def per_block_step(case, mode: str, rtol: float, groups: int):
    """One step of ``case`` (a test_hf_models case) clipped per block (``groups`` of them),
    each group's bound its median float64 norm, against the float64 reference; the wrapper."""
    import test_hf_models as H

    ref = H.reference(case)
    own = H.reference(case, dtype=None)  # plain autograd in the model's precision
    group_of = reference_groups(case.model, "groups", per_block)
    G = max(group_of.values()) + 1
    assert G == groups
    want = group_norms(ref, group_of, G)
    bounds = [float(want[g].median()) for g in range(G)]
    model = copy.deepcopy(case.model)
    wrapped = dpgrad.GradSampleModuleFastGradientClipping(
        model, clipping="groups", clipping_groups=per_block, max_grad_norm=bounds, single_backward=mode == "single")
    args, shape = case.forward(wrapped, slice(None))
    criterion(wrapped, "mean")(*args, shape=shape).backward()
    norms = wrapped.per_sample_group_norms
    for g in range(G):
        assert_norms_close(norms[g], want[g], f"group {g} norms", rtol)
    coef = (torch.tensor(bounds, dtype=torch.float64, device=norms.device)[:, None] / (norms.double() + 1e-6)).clamp(max=1.0)
    assert (coef < 1).any() and (coef == 1).any()
    params = dict(model.named_parameters())
    for n, g in ref.items():
        c = coef[group_of[n]]
        expected = torch.einsum("b,b...->...", c, g)
        scale = (c[:, None] * g.flatten(1).abs()).sum(0).max().item()
        # Gradients zero in exact arithmetic (an attention key bias) are rounding noise.
        autograd_error = (torch.einsum("b,b...->...", c, own[n].double()) - expected).abs().max().item()
        assert params[n].grad is not None and params[n].grad.dtype == params[n].dtype, n
        assert_tensor_close(params[n].grad, expected, f"clipped {n}.grad", max(scale, 4 * autograd_error / rtol), rtol)
    return wrapped
