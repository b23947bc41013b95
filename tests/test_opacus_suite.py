"""Opacus 1.6.0's own test classes, run with dpgrad's wrappers in place of Opacus's.

The tests ship inside the Opacus wheel (``opacus.tests``). We subclass them here, so pytest
collects them from this module, and substitute dpgrad's classes while each test runs:

* ``grad_samples.linear_test`` / ``embedding_test`` (and ``layer_norm_test`` /
  ``rms_norm_test`` / ``conv1d_test`` / ``conv2d_test`` / ``conv3d_test`` / ``group_norm_test``,
  for dpgrad's other registered samplers) build their wrapper through
  ``opacus.utils.per_sample_gradients_utils.wrap_model``; it is replaced by
  ``_dpgrad_wrap_model`` ("hooks"/"ew" -> ``dpgrad.GradSampleModule``, "functorch" -> the
  same with ``force_functorch=True``, "ghost" -> ``dpgrad.GradSampleModuleFastGradientClipping``).
* ``grad_sample_module_test`` / ``grad_sample_module_fast_gradient_clipping_test`` use the
  names ``GradSampleModule``, ``GradSampleModuleFastGradientClipping`` and
  ``register_grad_sampler`` from their module globals, which are patched to dpgrad's, and
  ``CLS``, which our subclasses set; ``grad_sample_hooks_fast_gradient_clipping_test`` (the
  no-wrap mode) uses ``GradSampleHooksFastGradientClipping`` too, patched to dpgrad's.
* ``grad_samples.embedding_norm_sample_test`` (hand-computed Embedding gradient norms) calls
  ``embedding_norm_sample.compute_embedding_norm_sample``; that name, in the test module, is
  pointed at dpgrad's Embedding norm sampler.

Hypothesis runs Opacus's own settings (100 examples per test) in the first pass; in the
Triton pass, where the interpreter makes each draw slow, a quarter of them (a profile loaded
before Opacus's test modules build their settings), as for dpgrad's own random-model tests.

The substitution is checked, not assumed: while a test runs, constructing any Opacus wrapper
raises (a tripwire on Opacus's ``AbstractGradSampleHooks.__init__``), and every test that
builds wrappers asserts that dpgrad's were built. Only the Opacus *modules* are imported
here: pytest collects every ``unittest.TestCase`` in this namespace, and Opacus's original
classes must not run.

Opacus's tests leak global state (``torch.set_default_dtype(torch.float64)``, the global RNG
seed, deterministic-algorithms mode, registrations); an autouse fixture restores it.
"""

from __future__ import annotations

import sys
import types
from unittest import mock

import pytest

pytest.importorskip("opacus")
pytest.importorskip("hypothesis")

import hypothesis  # noqa: E402
import torch  # noqa: E402
from _opacus_shims import import_opacus_test_module  # noqa: E402
from per_sample_reference import examples  # noqa: E402
from opacus.grad_sample import gsm_base  # noqa: E402
from opacus.grad_sample.grad_sample_module import GradSampleHooks  # noqa: E402
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (  # noqa: E402
    GradSampleHooksFastGradientClipping,
)
from opacus.utils import per_sample_gradients_utils  # noqa: E402

import dpgrad  # noqa: E402
from dpgrad.samplers import registry  # noqa: E402
from dpgrad.samplers.embedding import embedding_norm_sample  # noqa: E402

pytestmark = pytest.mark.opacus

# Before the imports below: a settings decorator takes its unset fields from the profile
# loaded when it is built.
hypothesis.settings.register_profile("dpgrad-opacus-suite", max_examples=examples(100))
hypothesis.settings.load_profile("dpgrad-opacus-suite")
_linear_test = import_opacus_test_module("grad_samples.linear_test")
_embedding_test = import_opacus_test_module("grad_samples.embedding_test")
_layer_norm_test = import_opacus_test_module("grad_samples.layer_norm_test")
_rms_norm_test = import_opacus_test_module("grad_samples.rms_norm_test")
_embedding_norm_test = import_opacus_test_module("grad_samples.embedding_norm_sample_test")
_conv1d_test = import_opacus_test_module("grad_samples.conv1d_test")
_conv2d_test = import_opacus_test_module("grad_samples.conv2d_test")
_conv3d_test = import_opacus_test_module("grad_samples.conv3d_test")
_group_norm_test = import_opacus_test_module("grad_samples.group_norm_test")
_gsm_test = import_opacus_test_module("grad_sample_module_test")
_fgc_test = import_opacus_test_module("grad_sample_module_fast_gradient_clipping_test")
_hooks_test = import_opacus_test_module("grad_sample_hooks_fast_gradient_clipping_test")

# Types of every wrapper built while a test runs (appended by the patched GradSampleModule._wrap).
_BUILT: list = []
# (grad_sample_mode, wrapper) for every call of the substituted wrap_model.
_WRAPPED: list = []


def _dpgrad_wrap_model(model, grad_sample_mode, wrap_model=True, *args, **kwargs):
    """Stand-in for ``opacus.grad_sample.wrap_model`` that builds dpgrad's wrappers."""
    if grad_sample_mode in ("hooks", "ew"):
        cls = dpgrad.GradSampleModule
    elif grad_sample_mode == "functorch":
        cls = dpgrad.GradSampleModule
        kwargs["force_functorch"] = True
    elif grad_sample_mode == "ghost":
        cls = dpgrad.GradSampleModuleFastGradientClipping
    else:
        raise ValueError(f"no dpgrad wrapper for grad_sample_mode={grad_sample_mode!r}")
    wrapper = cls(model, *args, **kwargs)
    _WRAPPED.append((grad_sample_mode, wrapper))
    if not wrap_model:  # the model left as it is: the hooks object of the wrapper
        hooks = dpgrad.GradSampleHooksFastGradientClipping if grad_sample_mode == "ghost" else dpgrad.GradSampleHooks
        return hooks.of(wrapper)
    return wrapper


def _recording_embedding_norm_sample(layer, activations, backprops):
    """dpgrad's Embedding norm sampler, recorded, for Opacus's embedding_norm_sample_test."""
    _WRAPPED.append(("norm_sampler", embedding_norm_sample))
    return embedding_norm_sample(layer, activations, backprops)


def _refuse_opacus_wrapper(self, *args, **kwargs):
    raise AssertionError(
        f"Opacus's own {type(self).__name__} was built inside the dpgrad suite: the "
        "substitution of dpgrad's wrappers did not take effect"
    )


@pytest.fixture(autouse=True)
def _dpgrad_in_place_of_opacus(monkeypatch):
    """Route every wrapper Opacus's tests build to dpgrad's classes, for one test."""
    original_wrap = dpgrad.GradSampleModule._wrap  # what every dpgrad wrapper's constructor ends in

    def recording_wrap(self, *args, **kwargs):
        _BUILT.append(type(self))
        original_wrap(self, *args, **kwargs)

    monkeypatch.setattr(dpgrad.GradSampleModule, "_wrap", recording_wrap)
    monkeypatch.setattr(gsm_base.AbstractGradSampleHooks, "__init__", _refuse_opacus_wrapper)
    monkeypatch.setattr(per_sample_gradients_utils, "wrap_model", _dpgrad_wrap_model)
    # That test calls `embedding_norm_sample.compute_embedding_norm_sample(layer, acts, bps)`.
    monkeypatch.setattr(
        _embedding_norm_test,
        "embedding_norm_sample",
        types.SimpleNamespace(compute_embedding_norm_sample=_recording_embedding_norm_sample),
    )
    for module in (_gsm_test, _fgc_test):
        monkeypatch.setattr(module, "GradSampleModule", dpgrad.GradSampleModule)
    monkeypatch.setattr(_gsm_test, "register_grad_sampler", dpgrad.register_grad_sampler)
    monkeypatch.setattr(
        _fgc_test, "GradSampleModuleFastGradientClipping", dpgrad.GradSampleModuleFastGradientClipping
    )
    # The no-wrap test builds both by these names (dpgrad's hooks object holds a dpgrad wrapper).
    monkeypatch.setattr(
        _hooks_test, "GradSampleModuleFastGradientClipping", dpgrad.GradSampleModuleFastGradientClipping
    )
    monkeypatch.setattr(
        _hooks_test, "GradSampleHooksFastGradientClipping", dpgrad.GradSampleHooksFastGradientClipping
    )
    yield
    _BUILT.clear()
    _WRAPPED.clear()


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Undo what Opacus's tests change globally: default dtype, RNG, determinism, registries."""
    dtype = torch.get_default_dtype()
    rng = torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled()
    registries = [
        registry.GRAD_SAMPLERS,
        registry.NORM_SAMPLERS,
        GradSampleHooks.GRAD_SAMPLERS,
        GradSampleHooksFastGradientClipping.NORM_SAMPLERS,
    ]
    saved = [dict(r) for r in registries]
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)
        torch.use_deterministic_algorithms(deterministic)
        for r, content in zip(registries, saved):
            r.clear()
            r.update(content)


class _BuildsDpgradWrappers:
    """Mixin: after each test, assert that it built dpgrad wrappers (and, by the tripwire,
    no Opacus ones). Skipped tests never reach setUp/tearDown, so they are not checked."""

    def setUp(self):
        self._built_before = len(_BUILT)
        super().setUp()

    def tearDown(self):
        super().tearDown()
        built = _BUILT[self._built_before :]
        assert built, "this test built no wrapper: the substitution of dpgrad's classes is not exercised"
        assert all(issubclass(t, dpgrad.GradSampleModule) for t in built), built


class _ChecksWrapModel:
    """Mixin for Opacus's ``GradSampleHooks_test``: every per-sample gradient it compares
    with the microbatch reference must come from the dpgrad wrapper of the requested mode."""

    def run_test_with_reduction(self, *args, grad_sample_mode="hooks", **kwargs):
        start = len(_WRAPPED)
        super().run_test_with_reduction(*args, grad_sample_mode=grad_sample_mode, **kwargs)
        calls = _WRAPPED[start:]
        assert len(calls) == 1, f"expected one wrap_model call, got {len(calls)}"
        mode, wrapper = calls[0]
        assert mode == grad_sample_mode
        expected = (
            dpgrad.GradSampleModuleFastGradientClipping if mode == "ghost" else dpgrad.GradSampleModule
        )
        assert type(wrapper) is expected, type(wrapper)
        assert wrapper.force_functorch == (mode == "functorch")


def test_torchvision_stand_in_is_gone_after_import():
    """The stand-in (see _opacus_shims) served the imports above and left sys.modules."""
    mod = sys.modules.get("torchvision")
    assert mod is None or "stand-in" not in getattr(mod, "__version__", ""), mod
    assert _gsm_test.FakeData(size=2, image_size=(3, 4, 4), num_classes=3)[1][0].shape == (3, 4, 4)


# ---------------------------------------------------------------- per-layer grad samplers
class TestOpacusLinear(_ChecksWrapModel, _linear_test.Linear_test):
    """Opacus's Linear per-sample gradient test (hooks, functorch, ew) on dpgrad."""


class TestOpacusEmbedding(_ChecksWrapModel, _embedding_test.Embedding_test):
    """Opacus's Embedding per-sample gradient test (hooks, functorch, ew) on dpgrad."""


class TestOpacusLayerNorm(_ChecksWrapModel, _layer_norm_test.LayerNorm_test):
    """Opacus's LayerNorm per-sample gradient test (hooks, functorch, ew) on dpgrad."""


class TestOpacusRMSNorm(_ChecksWrapModel, _rms_norm_test.RMSNorm_test):
    """Opacus's RMSNorm per-sample gradient test (hooks, functorch) on dpgrad."""


class TestOpacusConv1d(_ChecksWrapModel, _conv1d_test.Conv1d_test):
    """Opacus's Conv1d per-sample gradient test (hooks, functorch, ew) on dpgrad."""


class TestOpacusConv2d(_ChecksWrapModel, _conv2d_test.Conv2d_test):
    """Opacus's Conv2d per-sample gradient and unfold tests on dpgrad (its swap of Opacus's own
    Conv2d sampler leaves dpgrad's registry alone: dpgrad's sampler runs both times)."""

    def test_asymetric_dilation_and_kernel_size(self):
        # Builds its wrapper by the name GradSampleModule of its module: dpgrad's here.
        start = len(_BUILT)
        with mock.patch.object(_conv2d_test, "GradSampleModule", dpgrad.GradSampleModule):
            super().test_asymetric_dilation_and_kernel_size()
        assert _BUILT[start:] == [dpgrad.GradSampleModule]


class TestOpacusConv3d(_ChecksWrapModel, _conv3d_test.Conv3d_test):
    """Opacus's Conv3d per-sample gradient test on dpgrad."""


class TestOpacusGroupNorm(_ChecksWrapModel, _group_norm_test.GroupNorm_test):
    """Opacus's GroupNorm per-sample gradient test on dpgrad."""


class TestOpacusEmbeddingNormSample(_embedding_norm_test.TestComputeEmbeddingNormSample):
    """Opacus's hand-computed Embedding gradient norms, checked against dpgrad's norm sampler."""

    def tearDown(self):
        super().tearDown()
        assert _WRAPPED and all(fn is embedding_norm_sample for _, fn in _WRAPPED), _WRAPPED


# ---------------------------------------------------------------- the wrappers
class TestOpacusGradSampleModule(_BuildsDpgradWrappers, _gsm_test.GradSampleModuleTest):
    """Opacus's GradSampleModule tests with ``CLS = dpgrad.GradSampleModule``."""

    CLS = dpgrad.GradSampleModule


class TestOpacusFastGradientClipping(
    _BuildsDpgradWrappers, _fgc_test.GradSampleModuleFastGradientClippingTest
):
    """Opacus's ghost-clipping tests (and the inherited GradSampleModule tests) with
    ``CLS = dpgrad.GradSampleModuleFastGradientClipping``."""

    CLS = dpgrad.GradSampleModuleFastGradientClipping


class TestOpacusFastGradientClippingEmbedding(
    _BuildsDpgradWrappers, _fgc_test.GradSampleModuleFastGradientClippingEmbeddingLayerTest
):
    """Opacus's ghost-clipping tests of an Embedding layer, on dpgrad."""


class TestOpacusHooksFastGradientClipping(
    _BuildsDpgradWrappers, _hooks_test.GradSampleHooksFastGradientClippingTest
):
    """Opacus's no-wrap tests (``GradSampleHooksFastGradientClipping`` on the model itself) with
    ``dpgrad.GradSampleHooksFastGradientClipping``."""


class TestOpacusDPTensorArithmetic(_fgc_test.DPTensorArithmeticTest):
    """Opacus's arithmetic on the loss wrapper that drives dpgrad's two backward passes."""
