"""The ``dpgrad`` command line (also ``python -m dpgrad``).

``dpgrad autotune-report``: one DP step of a built-in model, and per layer what the autotuner
chose, its time and Opacus's on the same inputs, and the speedup (--full: every candidate's
time, the config and the extra memory). The default command.

``dpgrad demo``: a short DP-SGD training run of the built-in transformer with ghost clipping
(one backward pass per step unless --backward double), printing the loss and per-sample
gradient-norm statistics of every step.

``dpgrad dashboard RESULTS... -o report.html``: one self-contained HTML page of charts and
tables from benchmark results files (benchmarks/results/*.json); ``--records`` writes them as
flat records for dashboard tools, ``--markdown`` prints the README's results tables,
``--update-readme`` puts them into a README and ``--summary`` ends with a short summary.

``dpgrad audit``: a one-run privacy audit of DP-SGD as dpgrad trains (white-box gradient
canaries, or black-box input canaries, through ``dpgrad.opacus.make_private`` or
``dpgrad.hf.DPTrainer``), beside the same audit of the idealised
Gaussian mechanism: the accountant's epsilon and the audited lower bounds (Steinke et al.'s
and the f-DP one), per noise multiplier.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

from dpgrad.fast_gradient_clipping import GradSampleModuleFastGradientClipping
from dpgrad.tools.cli_audit import audit_command
from dpgrad.tools.cli_common import device_arg, hf_overrides, number_in, unwritable, write_text
from dpgrad.tools.models import TinyTransformer, TinyTransformerConfig, dp_sgd_step, per_sample_lm_loss, synthetic_batch


def _doc(paragraph: int) -> str:
    """A paragraph of this module's docstring, for help texts."""
    return __doc__.split("\n\n")[paragraph].replace("``", "")


def demo(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="dpgrad demo", description=_doc(2))
    max_len = TinyTransformerConfig().max_seq_len
    parser.add_argument("--steps", type=number_in(int, 1), default=30, help="training steps (default 30)")
    parser.add_argument("--batch-size", type=number_in(int, 1), default=64, help="samples per step (default 64)")
    parser.add_argument("--seq-len", type=number_in(int, 2, max_len), default=64,
                        help=f"tokens per sample, 2 to {max_len} (default 64)")
    parser.add_argument("--max-grad-norm", type=number_in(float, 0, low_open=True), default=1.0,
                        help="the clipping bound C (default 1.0)")
    parser.add_argument("--noise-multiplier", type=number_in(float, 0), default=0.5,
                        help="noise standard deviation over C (default 0.5)")
    parser.add_argument("--lr", type=number_in(float, 0, low_open=True), default=1e-2,
                        help="Adam's learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    parser.add_argument("--backward", choices=["single", "double"], default="single",
                        help="one backward pass per step (default) or Opacus's two")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = TinyTransformerConfig()
    model = GradSampleModuleFastGradientClipping(
        TinyTransformer(cfg), max_grad_norm=args.max_grad_norm, loss_reduction="mean",
        single_backward=args.backward == "single",
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"dpgrad demo: TinyTransformer ({n_params / 1e6:.2f}M parameters, {cfg.n_layers} layers, "
        f"d_model {cfg.d_model}), batch {args.batch_size} x {args.seq_len} tokens, "
        f"C = {args.max_grad_norm}, sigma = {args.noise_multiplier}, {args.backward} backward, device cpu"
    )
    print(f"{'step':>4} {'loss':>8} {'norm min':>9} {'median':>9} {'max':>9} {'clipped':>8} {'time s':>7}")
    for step in range(1, args.steps + 1):
        ids = synthetic_batch(cfg, args.batch_size, args.seq_len, generator=gen)
        start = time.perf_counter()
        loss_per_sample = per_sample_lm_loss(model(ids), ids, cfg.padding_idx)
        norms = dp_sgd_step(model, optimizer, loss_per_sample, args.noise_multiplier, gen)
        elapsed = time.perf_counter() - start
        clipped = (norms > args.max_grad_norm).float().mean().item()
        print(
            f"{step:>4} {loss_per_sample.mean().item():>8.4f} {norms.min().item():>9.4f} "
            f"{norms.median().item():>9.4f} {norms.max().item():>9.4f} {clipped:>8.0%} {elapsed:>7.3f}"
        )
    return 0


REPORT_EPILOG = """\
defaults: on CUDA, --model gpt2-small --seq-len 1024 --dtype bf16; otherwise --model tiny
--seq-len 128 --dtype fp32 (seconds on a laptop CPU; there the eager fallback is reported,
since the Triton kernels run on CUDA tensors); the default --seq-len is lowered to the
model's maximum where that is less. --batch-size defaults to 8.

DPGRAD_TUNE: the report sets it to "on" (time new shapes) unless it is set already
("cached": stored choices, else the cost model; "off": the cost model). Measured choices are
saved in the per-device store (DPGRAD_TUNE_DIR, else ~/.cache/dpgrad/tune) and reused.

exit status: 0 on success; 1 when an output file could not be written after all; 2 for a
usage error (an unknown --model or --device, a --batch-size below 1, a --seq-len below 2 or
above the model's maximum, hf: without transformers, an --hf-config field the model's config
does not have or of the wrong type, a --json or --markdown path that cannot be written), with
a message saying what to pass instead. The output paths are checked before the run.
"""


def autotune_report(argv: List[str]) -> int:
    from dpgrad.tools import presets, report  # here: torch-heavy, and `dpgrad demo` does not need them

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        prog="dpgrad autotune-report", description=_doc(1),
        epilog=REPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help=f"a preset or Hugging Face architecture: {presets.model_names()}")
    parser.add_argument("--batch-size", type=number_in(int, 1), default=8, help="samples per batch (default 8)")
    parser.add_argument("--seq-len", type=number_in(int, 2),
                        help="tokens per sample, 2 to the model's maximum (default 1024 on CUDA, 128 otherwise)")
    parser.add_argument("--dtype", choices=list(presets.DTYPES), help="default bf16 on CUDA, fp32 otherwise")
    parser.add_argument("--device", type=device_arg, default="cuda" if cuda else "cpu",
                        help=f"cpu, cuda or cuda:N (default {'cuda' if cuda else 'cpu'})")
    parser.add_argument("--json", metavar="PATH|-", help="also write the report as JSON ('-': stdout, no table)")
    parser.add_argument("--markdown", metavar="PATH|-", help="also write a Markdown table ('-': stdout, no table)")
    parser.add_argument("--no-opacus", action="store_true", help="do not time Opacus's samplers for the speedup")
    parser.add_argument("--full", action="store_true",
                        help="the full table: every candidate's time, the config and the memory estimate")
    parser.add_argument("--retune", action="store_true",
                        help="measure every layer shape of this model again and replace its stored choice "
                             "(the store's other entries stay)")
    parser.add_argument("--hf-config", metavar="KEY=VALUE", action="append", default=[],
                        help="override a config field of an hf: model, e.g. num_hidden_layers=2 (repeatable)")
    args = parser.parse_args(argv)
    hf_config = hf_overrides(parser, args.hf_config)

    on_cuda = args.device.startswith("cuda")
    if on_cuda and not cuda:
        parser.error(f"--device {args.device}: CUDA is not available here; use --device cpu")
    index = torch.device(args.device).index
    if on_cuda and index is not None and index >= torch.cuda.device_count():
        parser.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    for option, path in (("--json", args.json), ("--markdown", args.markdown)):
        why = unwritable(path) if path and path != "-" else None
        if why is not None:
            parser.error(f"{option} {path}: cannot write there ({why}); give a writable file path")
    model = args.model or ("gpt2-small" if on_cuda else "tiny")
    if args.json == "-" and args.markdown == "-":
        parser.error("--json - and --markdown - would both go to stdout: give one of them a file path")
    try:
        presets.check_name(model)
        presets.check_hf_config(model, hf_config)
        seq_len = args.seq_len
        max_len = presets.max_seq_len(model)
        if max_len is not None:
            if seq_len is None:
                seq_len = min(1024 if on_cuda else 128, max_len)
            presets.check_seq_len(model, seq_len, max_len)
        elif seq_len is None:
            seq_len = 1024 if on_cuda else 128
    except ValueError as exc:
        parser.error(str(exc))
    settings = report.ReportSettings(model=model, batch_size=args.batch_size, seq_len=seq_len,
                                     dtype=args.dtype or ("bf16" if on_cuda else "fp32"), device=args.device,
                                     opacus=not args.no_opacus, hf_config=hf_config, retune=args.retune)
    try:
        result = report.run_report(settings)
    except ValueError as exc:  # an hf: model whose maximum length is known only once built
        parser.error(str(exc))
    outputs = {"json": (args.json, lambda r: json.dumps(r, indent=2) + "\n"),
               "markdown": (args.markdown, report.format_markdown)}
    if "-" not in (args.json, args.markdown):
        sys.stdout.write(report.format_table(result, full=args.full))
    elif result["notice"]:
        print(result["notice"], file=sys.stderr)
    status = 0
    for name, (path, render) in outputs.items():
        if path == "-":
            sys.stdout.write(render(result))
        elif path:
            if write_text(path, render(result), f"{name} report"):
                print(f"wrote the {name} report to {path}", file=sys.stderr)
            else:
                status = 1
    return status


def dashboard(argv: List[str]) -> int:
    from dpgrad.tools import dashboard as page
    from dpgrad.tools import results, results_tables

    parser = argparse.ArgumentParser(prog="dpgrad dashboard", description=_doc(3))
    parser.add_argument("results", nargs="+", help="results files written by the benchmarks")
    parser.add_argument("-o", "--output", help="the HTML page to write")
    parser.add_argument("--records", help="write the flat records (JSON) to this file ('-': stdout)")
    parser.add_argument("--markdown", action="store_true", help="print the README's results tables")
    parser.add_argument("--update-readme", metavar="PAGE", help="put the results tables into this Markdown page "
                        "(docs/results.md)")
    parser.add_argument("--summary", nargs="?", const="", metavar="REPORT_JSON",
                        help="end with a short summary (with an autotune report's JSON: its choices too)")
    args = parser.parse_args(argv)
    if not (args.output or args.records or args.markdown or args.update_readme):
        parser.error("say what to write: -o report.html, --records FILE, --markdown or --update-readme README")
    missing = page.plotly_missing() if args.output else None  # before anything is read or made
    if missing is not None:
        parser.error(f"-o {args.output}: {missing}")
    if args.output:
        try:  # the page's directory is made if missing
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"-o {args.output}: cannot make its directory ({exc.strerror or exc})")
    for option, path in (("-o", args.output), ("--records", args.records), ("--update-readme", args.update_readme)):
        why = unwritable(path) if path and path != "-" else None
        if why is not None:
            parser.error(f"{option} {path}: cannot write there ({why})")
    try:
        docs = results.load(args.results)
    except ValueError as exc:
        parser.error(str(exc))
    autotune = None
    if args.summary:
        try:
            autotune = json.loads(Path(args.summary).read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--summary {args.summary}: not an autotune report's JSON ({exc})")
        problem = results_tables.report_problem(autotune)
        if problem is not None:
            parser.error(f"--summary {args.summary}: not an autotune report's JSON ({problem})")
    status = 0
    if args.output:
        if write_text(args.output, page.render(docs, autotune), "dashboard"):
            print(f"wrote the dashboard to {args.output}", file=sys.stderr)
        else:
            status = 1
    if args.records:
        text = json.dumps(results.flat_records(docs), indent=1) + "\n"
        if args.records == "-":
            sys.stdout.write(text)
        elif not write_text(args.records, text, "records"):
            status = 1
    if args.markdown:
        sys.stdout.write(results_tables.markdown(docs))
    if args.update_readme:
        try:
            text = results_tables.readme_with_results(Path(args.update_readme).read_text(encoding="utf-8"), docs)
        except (OSError, ValueError) as exc:
            parser.error(f"--update-readme {args.update_readme}: {exc}")
        if write_text(args.update_readme, text, "results tables"):
            print(f"updated the results in {args.update_readme}", file=sys.stderr)
        else:
            status = 1
    if args.summary is not None:
        sys.stderr.flush()
        sys.stdout.write(results_tables.summary(docs, autotune, args.output))
    return status


SUMMARIES = {
    "autotune-report": "per layer, the kernel the autotuner chose and its time against Opacus's (the default)",
    "demo": "a short DP-SGD training run of the built-in transformer",
    "dashboard": "one HTML page of charts and tables from benchmark results files",
    "audit": "a one-run privacy audit of DP-SGD as dpgrad trains",
}
COMMANDS = {"autotune-report": autotune_report, "demo": demo, "dashboard": dashboard, "audit": audit_command}
USAGE = f"usage: dpgrad {{{','.join(COMMANDS)}}} [options]   (dpgrad COMMAND --help; no command: autotune-report)"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("dpgrad: no command given, running `dpgrad autotune-report` (see dpgrad --help)", file=sys.stderr)
        return autotune_report([])
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        print("\n".join("  " + " ".join(_doc(i).split()) for i in (1, 2, 3, 4)))
        return 0
    if argv[0] not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"dpgrad: unknown command {argv[0]!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
              "the commands are:", file=sys.stderr)
        for name, summary in SUMMARIES.items():
            print(f"  {name:<16} {summary}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
