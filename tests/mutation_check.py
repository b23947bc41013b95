"""Mutation check of the code that carries dpgrad's privacy guarantee.

Each mutant below is one small edit (an operator flipped, a term dropped, a scale forgotten, a
bound changed, a condition negated) to the eager (CPU) code of the clipping coefficients, the
per-sample norms of each sampler, the clipped sums, the finish plan, the noise, the
accountant's sample rate, the independence probes or the training-loop handling. For each
mutant the runner applies the edit in place, runs the tests, records whether they failed
(the mutant is "killed") and which test failed first, then restores the file exactly.

Run it on a scratch worktree, never on a checkout with work in progress:

    git worktree add /tmp/dpgrad-mutants HEAD
    python tests/mutation_check.py --root /tmp/dpgrad-mutants --out mutants.md
    python tests/mutation_check.py --root /tmp/dpgrad-mutants --ids m08,m14 --tests tests/test_reference_kernels.py
    python tests/mutation_check.py --root /tmp/dpgrad-mutants --pytest-args "-n 2 --dist loadgroup"
    python tests/mutation_check.py --list

By default the tests are the Makefile's FAST_TESTS (``make test-fast``) under ``pytest -x -q
-ra``; ``--extra`` also runs the modules a mutant names as its own (the experts and the
Hugging Face trainer are tested outside FAST_TESTS). Each mutant's own modules and those of
its area run first (``FIRST``): the same tests, ordered so that a kill comes early under -x.
``--cmd`` replaces the whole command.
Environment variables (DPGRAD_BACKEND, ...) pass through to the tests; the runner makes sure
they import dpgrad and dpgrad.kernels from --root (an editable install of another checkout
would serve its own kernels/). ``--out`` writes a Markdown table and a JSON file beside it.
Every start checks that each mutant's old text occurs exactly once in its file and that the
mutated file compiles; ``--list`` does only that and prints the mutants. Exit status: 0 when
every mutant run was killed, 1 when some survived (or timed out, or ran no test), 2 when the
mutants themselves are broken, 130 when interrupted (the mutated file is restored first).
"""

from __future__ import annotations

import argparse
import json
import os
import py_compile
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COEF, SUMS, PLAN, NOISE = "clipping coefficients", "clipped sums", "finish plan", "noise"
RATE, PROBES, LOOP = "accountant sample rate", "independence probes", "training-loop handling"
AREAS = (COEF, SUMS, PLAN, NOISE, RATE, PROBES, LOOP)  # and "norms (<sampler>)"
MOE, HF = ("tests/test_moe.py",), ("tests/test_hf_trainer.py",)

# (id, area, file, old text (exactly once in the file), new text, what the edit does[, own tests])
MUTANTS = [
    ("m01", COEF, "dpgrad/clipping/coefficients.py", "    return coef if gamma is not None else coef.clamp_(max=scale)",
     "    return coef", "clamp dropped: coefficients above 1 scale small gradients up to C"),
    ("m02", COEF, "dpgrad/clipping/coefficients.py", "coef if gamma is not None else coef.clamp(max=1.0)",
     "coef if gamma is not None else coef.clamp(max=2.0)", "clamp bound changed: 1 -> 2 (per-group/per-sample bounds)"),
    ("m03", COEF, "dpgrad/clipping/coefficients.py", "    eps = 1e-6 if gamma is None else gamma", "    eps = 1e-6",
     "term dropped: automatic clipping's gamma replaced by 1e-6"),
    ("m04", COEF, "dpgrad/clipping/groups.py", "return self.squares(params, rows).sqrt()",
     "return self.squares(params, rows)", "sqrt dropped: a clipping group's squared norm used as its norm"),
    ("m05", COEF, "dpgrad/clipping/adaptive.py", "count = (norms <= bound).sum()", "count = (norms > bound).sum()",
     "condition negated: adaptive clipping counts the clipped samples as unclipped"),
    ("m06", COEF, "dpgrad/clipping/adaptive.py", "torch.exp(-self.clipbound_learning_rate *",
     "torch.exp(self.clipbound_learning_rate *", "sign flipped: the adaptive bound moves away from its quantile"),
    ("m07", COEF, "dpgrad/backward/clipped_backward.py", "self.gamma, self.sums.scale(norms.shape[0])))",
     "self.gamma, 1.0))", "scale forgotten: single backward's coefficients not times B under 'mean'"),
    ("m08", "norms (linear)", "kernels/reference_linear.py",
     "        return (gram_acc(A, G) * gram_acc(G, A)).sum(dim=(1, 2))",
     "        return (gram_acc(A, G) * gram_acc(G, A)).diagonal(dim1=1, dim2=2).sum(dim=1)",
     "term dropped: ghost norm keeps only t == t' (cross-token terms lost)"),
    ("m09", "norms (linear)", "kernels/reference_linear.py", "diagonal.view(B, -1).sum(1) + 2 * lower.sum(dim=(1, 2))",
     "diagonal.view(B, -1).sum(1) + lower.sum(dim=(1, 2))",
     "factor dropped: ghost norm by halves counts the cross block once"),
    ("m10", "norms (linear)", "kernels/reference_linear.py",
     "vector_norm(a, dim=(1, 2), dtype=acc) * torch.linalg.vector_norm(g,",
     "vector_norm(a, dim=(1, 2), dtype=acc) + torch.linalg.vector_norm(g,",
     "operator flipped: T == 1 norm ||a||*||g|| -> ||a||+||g||"),
    ("m11", "norms (linear)", "dpgrad/samplers/linear.py",
     "            rows.append(torch.linalg.vector_norm(bias_sums, dim=1))\n        return self._params(), rows",
     "            rows.append(torch.zeros_like(bias_sums[:, 0]))\n        return self._params(), rows",
     "term dropped: the bias's norm left out of a ghost Linear group's norms"),
    ("m12", "norms (shared uses)", "dpgrad/backward/norm_rows.py",
     "reference.outer_sum_inner(*uses[i], *uses[j]).to(sq.dtype), alpha=2)",
     "reference.outer_sum_inner(*uses[i], *uses[j]).to(sq.dtype), alpha=1)",
     "factor dropped: cross term of a parameter used twice counted once"),
    ("m13", "norms (all samplers)", "dpgrad/backward/norm_rows.py",
     'factor = rows.shape[1] if self.loss_reduction == "mean" else 1', "factor = 1",
     "scale forgotten: norms of the mean loss's backprops not times B"),
    ("m14", "norms (embedding)", "kernels/reference_embedding.py", "    starts[1:] = sorted_key[1:] != sorted_key[:-1]",
     "    starts[1:] = 1", "segments never merged: squares of rows summed, not squares of each token's sum"),
    ("m15", "norms (embedding)", "kernels/reference_embedding.py",
     "        tok = tok.masked_fill(tok == padding_idx, num_embeddings)\n    return tok, G.reshape",
     "        tok = tok\n    return tok, G.reshape",
     "mask dropped: padding_idx positions counted (norm and clipped sum)"),
    ("m16", "norms (embedding)", "dpgrad/samplers/embedding.py", '"embedding_norm", inputs, layer).sqrt()}',
     '"embedding_norm", inputs, layer)}', "sqrt dropped: the embedding's squared norm used as its norm"),
    ("m17", "norms (conv)", "dpgrad/samplers/conv.py", "for args, lyr in zip(inputs, self._layers)]).sqrt())",
     "for args, lyr in zip(inputs, self._layers)]))", "sqrt dropped: a convolution's squared norm used as its norm"),
    ("m18", "norms (conv)", "kernels/reference_conv.py", ".view(-1, g).sum(1)", ".view(-1, g)[:, 0]",
     "term dropped: a grouped convolution's norm from its first group only"),
    ("m19", "norms (norm layers)", "dpgrad/samplers/norms.py",
     "gw = total(_normalized(layer, x, acc, normalized) * backprops, shape, acc)",
     "gw = total(x.to(acc) * backprops, shape, acc)", "normalisation forgotten: weight gradient from the raw input"),
    ("m20", "norms (norm layers)", "dpgrad/samplers/norms.py",
     "F.group_norm(x.to(acc), layer.num_groups, eps=layer.eps)", "F.group_norm(x.to(acc), 1, eps=layer.eps)",
     "GroupNorm's groups ignored: normalised as one group"),
    ("m21", "norms (norm layers)", "dpgrad/samplers/norms.py",
     "return x.sum(dim=dims, dtype=dtype) if dims else x.to(dtype)",
     "return x.mean(dim=dims, dtype=dtype) if dims else x.to(dtype)",
     "token sum replaced by a mean (LayerNorm/RMSNorm)"),
    ("m22", "norms (experts)", "kernels/reference_experts.py", "M = (L @ L.T) * (R @ R.T) * same",
     "M = (L @ L.T) * (R @ R.T)", "mask dropped: other samples' pairs in a sample's Gram norm", MOE),
    ("m23", "norms (experts)", "dpgrad/samplers/experts.py", "segment_sq_norms(layer, pairs, left, right).sqrt() for",
     "segment_sq_norms(layer, pairs, left, right) for",
     "sqrt dropped: an expert weight's squared norm used as its norm", MOE),
    ("m24", "norms (experts)", "kernels/reference_experts.py",
     "rows.index_add_(0, sample * num_experts + expert, left.to(acc))",
     "rows.index_add_(0, sample * num_experts, left.to(acc))",
     "expert index dropped: bias rows summed across experts", MOE),
    ("m25", SUMS, "kernels/reference_linear.py", "        G = G * coefficients_in(column, G.dtype)", "        G = G",
     "scale forgotten: Linear GEMM clipped sum without coefficients (d >= p)"),
    ("m26", SUMS, "dpgrad/samplers/linear.py",
     "scaled = (reference.autocast_rounded(G, A, acc) * coef.sample_rows(weights, G)).view(L, -1, p)",
     "scaled = reference.autocast_rounded(G, A, acc).view(L, -1, p)",
     "coefficients dropped: stacked Linear layers' clipped sums unclipped"),
    ("m27", SUMS, "kernels/reference_embedding.py",
     "scaled = rows.to(acc).view(B, T, d) * coef.to(device=G.device, dtype=acc).view(B, 1, 1)",
     "scaled = rows.to(acc).view(B, T, d)", "coefficients dropped: embedding clipped sum unclipped"),
    ("m28", SUMS, "kernels/reference_conv.py",
     "scaled = Ga * coef.to(device=Ga.device, dtype=Ga.dtype).view(-1, *([1] * (Ga.dim() - 1)))", "scaled = Ga",
     "coefficients dropped: convolution clipped sum unclipped"),
    ("m29", SUMS, "dpgrad/samplers/groups.py", "grads[p] = g if p not in grads else grads[p] + g", "grads[p] = g",
     "term dropped: a parameter used twice keeps its last use's per-sample gradient"),
    ("m30", SUMS, "dpgrad/backward/clipped_sums.py", "sums[p] = s if p not in sums else sums[p] + s", "sums[p] = s",
     "term dropped: a parameter's sums from two groups overwrite each other"),
    ("m31", SUMS, "dpgrad/samplers/groups.py", "lambda: Coefficients(self._coef[row]))",
     "lambda: Coefficients(self._coef[0]))", "wrong row: every clipping group takes group 0's coefficients"),
    ("m32", SUMS, "dpgrad/backward/clipped_backward.py",
     "self._second_pass(coef.to(loss_per_sample.device) * loss_per_sample)", "self._second_pass(loss_per_sample)",
     "coefficients dropped: double backward's second pass unclipped"),
    ("m33", PLAN, "dpgrad/backward/finish_plan.py", "if not ghost[i] and i in shared_uses]",
     "if not ghost[i] and i not in shared_uses]", "condition negated: lone records summed twice, shared ones lost"),
    ("m34", PLAN, "dpgrad/backward/finish_plan.py",
     "self._grad_sample_groups(records, alone)\n                  + self._summed_groups(records, summed))",
     "self._grad_sample_groups(records, alone))", "term dropped: parameters used twice (per-sample path) left out"),
    ("m35", PLAN, "dpgrad/samplers/groups.py", "for (cls, *_), idx in keyed.items()] + singles",
     "for (cls, *_), idx in keyed.items()]", "term dropped: records without a group class left out of the plan"),
    ("m36", PLAN, "dpgrad/backward/norm_rows.py", "plan.combined = len(params) != len(set(params))",
     "plan.combined = False", "condition forced: a parameter's several uses never combined"),
    ("m37", NOISE, "dpgrad/opacus/optimizers.py",
     'std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier) * self.max_grad_norm',
     'std = getattr(self, "_adjusted_noise_multiplier", self.noise_multiplier)',
     "scale forgotten: std = sigma, not sigma * C"),
    ("m38", NOISE, "dpgrad/opacus/optimizers.py", "_draw_noise(noise, std / divisor, self.generator)",
     "_draw_noise(noise, std, self.generator)", "division forgotten: noise not divided by the expected batch size"),
    ("m39", NOISE, "dpgrad/opacus/optimizers.py", "silent = isinstance(std, (int, float)) and std == 0",
     "silent = isinstance(std, (int, float)) and std >= 0", "condition changed: any number std draws no noise"),
    ("m40", NOISE, "dpgrad/clipping/groups.py", "return math.sqrt(math.fsum(b * b for b in bounds))",
     "return max(bounds)", "noise scaled to the largest group bound, not sqrt(sum C_g^2)"),
    ("m41", NOISE, "dpgrad/clipping/adaptive.py", "(sigma ** -2 - (2.0 * batch_size / 20.0) ** -2) ** -0.5",
     "(sigma ** -2 + (2.0 * batch_size / 20.0) ** -2) ** -0.5",
     "operator flipped: adaptive noise multiplier too small"),
    ("m42", RATE, "dpgrad/opacus/engine.py", "get_optimizer_hook_fn(sample_rate=sample_rate))",
     "get_optimizer_hook_fn(sample_rate=1 / len(data_loader.dataset)))", "make_private records 1/N, not 1/len(loader)"),
    ("m43", RATE, "dpgrad/opacus/optimizers.py", 'return self.__dict__.get("_held_batches", 1)', "return 1",
     "accumulated batches ignored: the accountant records q, not k*q"),
    ("m44", RATE, "dpgrad/hf/trainer.py",
     "per_device_train_batch_size * args.gradient_accumulation_steps * self.world_size",
     "per_device_train_batch_size * self.world_size", "term dropped: DPTrainer's rate and batch forget accumulation"),
    ("m45", RATE, "dpgrad/hf/trainer.py", "self.expected_batch_size / len(self._units))",
     "self.expected_batch_size / len(dataset))", "DPTrainer's rate over rows, not sampling units (users)", HF),
    ("m46", PROBES, "dpgrad/checks/independence.py", "if not any(set(rows) <= own for rows in candidates):",
     "if not any(set(rows) >= own for rows in candidates):", "comparison flipped: rows beyond a set pass as its own"),
    ("m47", PROBES, "dpgrad/checks/independence.py", "TOLERANCE.get(rows.dtype, TOLERANCE[torch.float32]) * scale",
     "TOLERANCE.get(rows.dtype, TOLERANCE[torch.float32]) * 10 * scale", "tolerance raised tenfold (backward probes)"),
    ("m48", PROBES, "dpgrad/checks/independence.py", "itertools.combinations(range(n), n // 2)",
     "itertools.combinations(range(n), 1)", "probe sets no longer separate every pair of samples"),
    ("m49", PROBES, "dpgrad/checks/independence_check.py", "if key in self.probed and not self.due:",
     "if not self.due:", "condition changed: a new layout's model probes skipped"),
    ("m50", PROBES, "dpgrad/checks/forward_probe.py", "outside = [r for r in rows if r not in own]", "outside = []",
     "term dropped: rows the forward probe moved outside its set ignored"),
    ("m51", LOOP, "dpgrad/backward/grad_marks.py", "return 0, True  # a step took", "return 0, False  # a step took",
     "condition flipped: a released p.grad is added to, not cleared"),
    ("m52", LOOP, "dpgrad/backward/grad_marks.py", "held = max(held, mark.batches)", "held = max(held, 1)",
     "count dropped: accumulated loader batches not counted at the step"),
    ("m53", LOOP, "dpgrad/backward/clipped_backward.py", "max(1, held + another_batch)", "max(1, held)",
     "count dropped: a pass's own loader batch not counted"),
    ("m54", LOOP, "dpgrad/opacus/optimizers.py", "            self._drop_sums()\n            self._released",
     "            self._released", "call dropped: a released step's sums added again at the next step"),
    ("m55", LOOP, "dpgrad/loss.py", "loss_per_sample = loss_per_sample * weights", "loss_per_sample = loss_per_sample",
     "weight dropped: padding rows of fixed-shape batches contribute"),
]


def mutants() -> list:
    keys = ("id", "area", "path", "old", "new", "description")
    return [dict(zip(keys, m[:6]), extra=list(m[6] if len(m) > 6 else ())) for m in MUTANTS]


def check(root: Path, all_mutants: list) -> list:
    """Every mutant's problems (none when all are sound); fills in each one's line."""
    ids = [m["id"] for m in all_mutants]
    problems = [] if ids == [f"m{i:02d}" for i in range(1, len(ids) + 1)] else ["ids are not m01, m02, ... in order"]
    for m in all_mutants:
        where, path = f"{m['id']} ({m['path']})", root / m["path"]
        if not (m["area"] in AREAS or re.fullmatch(r"norms \(.+\)", m["area"])):
            problems.append(f"{where}: unknown area {m['area']!r}")
        if not m["path"].startswith(("dpgrad/", "kernels/")) or m["old"] == m["new"]:
            problems.append(f"{where}: not under dpgrad/ or kernels/, or no change")
        if not path.is_file():
            problems.append(f"{where}: no such file")
            continue
        text = path.read_text(encoding="utf-8")
        if text.count(m["old"]) != 1:
            problems.append(f"{where}: old text occurs {text.count(m['old'])} times, not once: {m['old']!r}")
            continue
        m["line"] = text[:text.index(m["old"])].count("\n") + 1
        with tempfile.TemporaryDirectory() as tmp:
            mutated = Path(tmp) / path.name
            mutated.write_text(text.replace(m["old"], m["new"], 1), encoding="utf-8")
            try:
                py_compile.compile(str(mutated), cfile=str(mutated) + "c", doraise=True)
            except py_compile.PyCompileError as exc:
                problems.append(f"{where}: the mutated file does not compile: {exc.msg.strip()}")
    return problems


def fast_tests(root: Path) -> list:
    """The Makefile's FAST_TESTS (backslash-continued lines), as paths under tests/."""
    found = re.search(r"^FAST_TESTS\s*:=((?:.*\\\n)*.*)$", (root / "Makefile").read_text(), re.M)
    if not found:
        sys.exit(f"no FAST_TESTS := in {root / 'Makefile'}")
    return ["tests/" + name for name in found.group(1).replace("\\\n", " ").split()]


# A sitecustomize for PYTHONPATH, used where the interpreter imports dpgrad or dpgrad.kernels from
# elsewhere than --root: an editable install of another checkout maps dpgrad.kernels to that
# checkout's kernels/ even when dpgrad itself comes from the current directory.
BOOT = """import importlib.util, os, sys
_MAP = {"dpgrad": %r, "dpgrad.kernels": %r}


class _Checkout:  # dpgrad and dpgrad.kernels from the checkout under test, ahead of any install
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in _MAP:
            return importlib.util.spec_from_file_location(
                name, os.path.join(_MAP[name], "__init__.py"), submodule_search_locations=[_MAP[name]])


sys.meta_path.insert(0, _Checkout)
"""
WHERE = "import dpgrad, dpgrad.kernels; print(dpgrad.__file__); print(dpgrad.kernels.__file__)"


def child_env(root: Path, boot_dir: str) -> dict:
    """The tests' environment: the caller's, writing no bytecode (a mutated file's would outlive
    it), and importing dpgrad and dpgrad.kernels from ``root`` (checked, not assumed)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    for attempt in range(2):
        found = subprocess.run([sys.executable, "-c", WHERE], cwd=root, env=env, capture_output=True, text=True)
        files = [Path(f).resolve() for f in found.stdout.split()]
        if found.returncode == 0 and len(files) == 2 and all(root in f.parents for f in files):
            return env
        Path(boot_dir, "sitecustomize.py").write_text(BOOT % (str(root / "dpgrad"), str(root / "kernels")))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [boot_dir, os.environ.get("PYTHONPATH")]))
    sys.exit(f"{sys.executable} imports dpgrad from elsewhere than {root}: {found.stdout}{found.stderr}")


def run(cmd: list, cwd: Path, timeout: float, env: dict):
    """(exit status, None on a timeout; output; seconds). The command's process group is killed
    on a timeout or an interrupt."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - start
    except BaseException as exc:  # the timeout, or KeyboardInterrupt
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return None, out, time.monotonic() - start


# The modules that test an area most directly run first (the same tests, in another order: a
# kill under -x comes in seconds rather than after the whole list).
FIRST = {
    COEF: ("test_reference_models.py", "test_clipping_groups.py", "test_automatic_clipping.py",
           "test_adaptive_clipping.py"),
    SUMS: ("test_reference_kernels.py", "test_clipping_groups.py", "test_shared_layers.py"),
    PLAN: ("test_shared_layers.py", "test_single_backward.py", "test_clipping_groups.py"),
    NOISE: ("test_dp_optimizer.py", "test_clipping_groups.py", "test_adaptive_clipping.py"),
    RATE: ("test_training_loops.py", "test_dp_optimizer.py", "test_fixed_batches.py"),
    PROBES: ("test_independence_probes.py", "test_independence.py", "test_guarantee.py"),
    LOOP: ("test_training_loops.py", "test_fixed_batches.py", "test_opacus_training_step.py"),
    "norms": ("test_reference_kernels.py", "test_conv.py", "test_shared_layers.py"),
}


def ordered(m: dict, tests: list) -> list:
    """``tests`` with the mutant's own modules and its area's first, the rest in their order."""
    first = [f"tests/{name}" for name in FIRST.get(m["area"].split(" (")[0], ())]
    front = [t for t in m["extra"] + first if t in tests]
    return list(dict.fromkeys(front + tests))


def first_failure(output: str) -> str:
    """The first ``FAILED <test id>`` or ``ERROR <test id>`` of pytest's short summary (-ra)."""
    found = re.search(r"^(FAILED|ERROR) (.+?)(?: - .*)?$", output, re.M)
    return f"{found.group(1)} {found.group(2)}" if found else ""


def verdict(status, failure: str = "") -> str:
    if status is None:
        return "timeout"
    if status == 2 and failure.startswith("FAILED"):  # -x under pytest-xdist: stopped after a failure
        return "killed"
    if status in (0, 1, 5):
        return {0: "survived", 1: "killed", 5: "no tests ran"}[status]
    return f"killed by error (exit {status})" if status in (2, 3, 4) else \
        f"killed by crash ({f'signal {-status}' if status < 0 else f'exit {status}'})"


def run_mutant(root: Path, m: dict, cmd: list, timeout: float, env: dict) -> dict:
    """Apply ``m`` in place, run ``cmd``, restore the file byte for byte (and its times)."""
    path = root / m["path"]
    original, stat = path.read_bytes(), path.stat()
    text = original.decode("utf-8")
    if text.count(m["old"]) != 1:
        raise SystemExit(f"{m['id']}: the old text is no longer exactly once in {path}")
    try:
        path.write_bytes(text.replace(m["old"], m["new"], 1).encode("utf-8"))
        status, output, seconds = run(cmd, root, timeout, env)
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    failure = first_failure(output)
    result = dict(m, result=verdict(status, failure), status=status, first_failure=failure,
                  seconds=round(seconds, 1), command=shlex.join(cmd))
    if status not in (0, 1):
        result["output_tail"] = output[-3000:]
    return result


def table(results: list) -> str:
    rows = ["| id | area | file:line | change | result | first failing test | seconds |", "|---" * 7 + "|"]
    for r in results:
        cells = (r["id"], r["area"], f"{r['path']}:{r['line']}", r["description"], r["result"], r["first_failure"],
                 r["seconds"])
        rows.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    killed = sum(r["result"].startswith("killed") for r in results)
    return "\n".join(rows) + f"\n\n{killed} of {len(results)} mutants killed.\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout to mutate in place (a scratch git worktree)")
    parser.add_argument("--ids", help="comma-separated mutant ids (default: all)")
    parser.add_argument("--tests", nargs="+", help="test paths or ids (default: the Makefile's FAST_TESTS)")
    parser.add_argument("--extra", action="store_true", help="also run each mutant's own test modules")
    parser.add_argument("--pytest-args", default="", help='extra pytest arguments, e.g. "-n 2 --dist loadgroup"')
    parser.add_argument("--cmd", help="the whole command to run instead (in --root)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mutant (default 1200)")
    parser.add_argument("--out", type=Path, help="the Markdown table to write (and a .json beside it)")
    parser.add_argument("--list", action="store_true", help="check and print the mutants, run nothing")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    # An interrupt or a termination (also where the shell ignores SIGINT) ends the run between
    # try and finally: the mutated file is restored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    all_mutants = mutants()
    problems = check(root, all_mutants)
    wanted = [i.strip() for i in (args.ids or "").split(",") if i.strip()]
    unknown = sorted(set(wanted) - {m["id"] for m in all_mutants})
    if problems or unknown:
        print("broken mutants:\n  " + "\n  ".join(problems + [f"unknown id {i}" for i in unknown]), file=sys.stderr)
        return 2
    chosen = [m for m in all_mutants if not wanted or m["id"] in wanted]
    if args.list:
        for m in chosen:
            own = f"  [own tests: {' '.join(m['extra'])}]" if m["extra"] else ""
            print(f"{m['id']}  {m['area']:<24} {m['path']}:{m['line']}  {m['description']}{own}")
        areas = [m["area"].split(" (")[0] for m in all_mutants]
        print(f"\n{len(all_mutants)} mutants, each old text found once, each mutated file compiling: "
              + ", ".join(f"{a} {areas.count(a)}" for a in dict.fromkeys(areas)))
        return 0

    tests = [t if "/" in t else "tests/" + t for t in (args.tests or fast_tests(root))]
    base = [sys.executable, "-m", "pytest", "-x", "-q", "-ra", "-p", "no:cacheprovider", "-p", "no:randomly",
            *shlex.split(args.pytest_args)]
    results = []
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as boot_dir:
        env = child_env(root, boot_dir)
        try:
            for m in chosen:
                own = [t for t in m["extra"] if args.extra and t not in tests]
                cmd = shlex.split(args.cmd) if args.cmd else base + ordered(m, tests + own)
                print(f"{m['id']} {m['path']}:{m['line']} {m['description']} ...", end=" ", flush=True)
                results.append(run_mutant(root, m, cmd, args.timeout, env))
                print(f"{results[-1]['result']} {results[-1]['first_failure']} ({results[-1]['seconds']} s)",
                      flush=True)
        except KeyboardInterrupt:
            print("\ninterrupted: the file was restored; the table holds the mutants run so far", file=sys.stderr)
    report = table(results)
    print("\n" + report)
    if args.out:
        args.out.write_text(report)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    if len(results) < len(chosen):
        return 130
    return 1 if any(r["result"] in ("survived", "timeout", "no tests ran") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
