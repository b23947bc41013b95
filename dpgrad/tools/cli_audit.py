"""``dpgrad audit``: the command line of the one-run privacy audit (``dpgrad.audit``).

Every argument and output path is checked, and every audit's settings made, before the first
step. A progress bar (tqdm, on a terminal only) counts the training steps of each noise
level; warnings that Opacus or torch give while training are collected and printed once each
after the table, not inside it. The table's first line gives delta, the sampling rate, the
steps and the rest of the setting; then, per noise multiplier and mechanism, the accountant's
epsilon and the audited lower bounds; then a
verdict per noise level: the audited bound at or below the accountant's epsilon is
consistent with the guarantee, above it is not.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import List

from dpgrad.tools.cli_common import hf_overrides, number_in, unwritable

DESCRIPTION = """\
A one-run privacy audit of DP-SGD as dpgrad trains (white-box gradient canaries, or black-box
input canaries, through dpgrad.opacus.make_private or dpgrad.hf.DPTrainer), beside the same
audit of the idealised Gaussian mechanism: the accountant's epsilon and the audited lower bounds
(Steinke et al.'s and the f-DP one), per noise multiplier."""

EPILOG = """\
verdict: an audited epsilon is a lower bound (at the confidence 0.95) on the epsilon the
training really has; the accountant's is an upper bound. "audited <= accountant: consistent"
is what a correct implementation gives; an audited bound above the accountant's epsilon means
the training leaks more than it accounts for (or, rarely, a 5% chance event).

exit status: 0 when every audit is consistent; 1 when the JSON could not be written after all;
2 for a usage error (checked before the first step); 3 when an audit of dpgrad's training is
not consistent with its accountant.
"""

INCONSISTENT = 3
HEADER = (f"{'noise':>6} {'mechanism':>16} {'accountant eps':>15} {'audited (one run)':>18} {'audited (f-DP)':>15} "
          f"{'guesses':>8} {'correct':>8}")


def parser_of() -> argparse.ArgumentParser:
    from dpgrad.tools import presets

    parser = argparse.ArgumentParser(prog="dpgrad audit", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise-multiplier", type=number_in(float, 0, low_open=True), nargs="+", default=[1.0],
                        help="one audit per noise multiplier (default 1.0)")
    parser.add_argument("--canaries", type=number_in(int, 2), default=1000, help="canaries (default 1000)")
    parser.add_argument("--samples", type=number_in(int, 0), default=1000, help="ordinary samples (default 1000)")
    parser.add_argument("--features", type=number_in(int, 1), default=8,
                        help="the linear model's input features (default 8)")
    parser.add_argument("--steps", type=number_in(int, 1), default=100, help="training steps (default 100)")
    parser.add_argument("--sample-rate", type=number_in(float, 0, 1, low_open=True), default=0.1,
                        help="Poisson sampling rate, 1/k for an integer k (default 0.1)")
    parser.add_argument("--delta", type=number_in(float, 0, 1, low_open=True), default=1e-5,
                        help="delta (default 1e-5)")
    parser.add_argument("--mode", choices=["white-box", "black-box"], default="white-box",
                        help="white-box: gradient canaries, every update observed (default); black-box: input "
                             "canaries scored by the final model's loss (the idealised row stays white-box)")
    parser.add_argument("--backward", choices=["single", "double"], default="single", help="backward passes per step")
    parser.add_argument("--clipping", choices=["flat", "per_layer", "per_block", "automatic"], default="flat",
                        help="flat: one bound for the whole gradient (default); per_layer, per_block: the audit "
                             "embedding C/sqrt(2), the model's parameters or blocks sharing the rest of C^2; "
                             "automatic: automatic clipping at C (gamma 0.01)")
    parser.add_argument("--path", choices=["make_private", "trainer"], default="make_private",
                        help="the training path audited: dpgrad.opacus.make_private (default) or dpgrad.hf.DPTrainer "
                             "(a language model, flat clipping)")
    parser.add_argument("--model", default="linear",
                        help="linear (a classifier on random features, the default) or a language model: "
                             f"{presets.model_names()}")
    parser.add_argument("--seq-len", type=number_in(int, 2), default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--hf-config", metavar="KEY=VALUE", action="append", default=[],
                        help="override a config field of an hf: model, e.g. num_hidden_layers=2 (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, canaries and noise (default 0)")
    parser.add_argument("--json", type=Path, help="write the audits as JSON to this file")
    return parser


def verdict(noise: float, results: list) -> tuple:
    """(line, consistent) for one noise level: dpgrad's audited bounds against its accountant."""
    real = [r for r in results if r.mechanism.startswith("dpgrad")]
    worst = max(max(r.epsilon_one_run, r.epsilon_fdp) for r in real)
    accountant = max(r.accountant_epsilon for r in real)
    if worst <= accountant:
        return f"noise {noise:g}: audited {worst:.3f} <= accountant {accountant:.3f}: consistent", True
    return (f"noise {noise:g}: audited {worst:.3f} > accountant {accountant:.3f}: NOT consistent (more leakage "
            "than accounted for, or a 5% chance event: run again with another --seed)"), False


def audit_command(argv: List[str]) -> int:
    from dpgrad.audit.run import AuditConfig, audit
    from dpgrad.tools import presets
    from dpgrad.tuning.progress import progress_bar

    parser = parser_of()
    args = parser.parse_args(argv)
    hf_config = hf_overrides(parser, args.hf_config)
    if args.json is not None:
        why = unwritable(str(args.json))
        if why is not None:
            parser.error(f"--json {args.json}: cannot write there ({why}); give a writable file path")
    try:
        configs = [AuditConfig(canaries=args.canaries, samples=args.samples, steps=args.steps, features=args.features,
                               sample_rate=args.sample_rate, noise_multiplier=noise, delta=args.delta,
                               single_backward=args.backward == "single", clipping=args.clipping, model=args.model,
                               seq_len=args.seq_len, seed=args.seed, path=args.path)
                   for noise in args.noise_multiplier]
        language_model = None
        if args.model != "linear":
            presets.check_name(args.model)
            presets.check_hf_config(args.model, hf_config)
            language_model = presets.audit_language_model(args.model, args.seq_len, **hf_config)
    except ValueError as exc:
        parser.error(str(exc))

    bar = progress_bar("audit", len(configs) * args.steps, " steps", leave=False, dynamic_ncols=True)
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            for config in configs:
                if bar is not None:
                    bar.set_postfix_str(f"noise {config.noise_multiplier:g}")
                step = bar.update if bar is not None else None
                try:
                    found.append([audit(config, mechanism, language_model, args.mode, on_step=step)
                                  for mechanism in ("dpgrad", "idealised")])
                except ValueError as err:
                    parser.error(str(err))
        finally:
            if bar is not None:
                bar.close()

    first = configs[0]
    print(f"audit: delta {first.delta:g}, sample rate {first.sample_rate:g}, {first.steps} steps, "
          f"{first.canaries} canaries, {first.samples} samples")
    print(f"       {args.mode}, {first.path}, {first.clipping} clipping, {args.backward} backward, "
          f"model {first.model}")
    print(HEADER)
    for config, results in zip(configs, found):
        for r in results:
            print(f"{config.noise_multiplier:>6g} {r.mechanism:>16} {r.accountant_epsilon:>15.3f} "
                  f"{r.epsilon_one_run:>18.3f} {r.epsilon_fdp:>15.3f} {r.guesses_one_run:>8} {r.correct_one_run:>8}")
    print()
    status = 0
    for config, results in zip(configs, found):
        line, consistent = verdict(config.noise_multiplier, results)
        print(line)
        status = status if consistent else INCONSISTENT
    seen = dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught)
    if seen:
        print("\nwarnings while training (each once):", file=sys.stderr)
        for text in seen:
            print(f"  {text}", file=sys.stderr)
    if args.json:
        rows = [r.to_json() for results in found for r in results]
        try:
            args.json.write_text(json.dumps({"audits": rows}, indent=1))
        except OSError as err:
            print(f"dpgrad audit: cannot write {args.json}: {err}", file=sys.stderr)
            return 1
    return status
