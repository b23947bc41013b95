"""What the ``dpgrad`` commands share: argument types that refuse out-of-range values as
usage errors, output paths checked before a long run, writing without a traceback, and
``--hf-config`` overrides."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

import torch


def number_in(kind: type, low: float, high: Optional[float] = None, low_open: bool = False):
    """An argparse ``type`` for numbers of ``kind`` from ``low`` (excluded if ``low_open``) to
    ``high``: every out-of-range value is refused the same way, as a usage error (exit 2)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            span = f"above {low}" if low_open else f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: pass a value {span}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def device_arg(text: str) -> str:
    """An argparse ``type`` for the report's device: cpu, cuda or cuda:N."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device: pass cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the report runs a model on cpu or cuda (cuda:N)")
    return text


def unwritable(path: str) -> Optional[str]:
    """Why ``path`` cannot be written, or None: looked at before a long run, not after it."""
    target = Path(path)
    if target.is_dir():
        return "it is a directory"
    if not target.parent.is_dir():
        return f"its directory {target.parent} does not exist"
    existed = target.exists()
    try:
        with open(target, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    if not existed:
        target.unlink(missing_ok=True)
    return None


def write_text(path: str, text: str, what: str) -> bool:
    """Write ``text`` to ``path``; on failure say so on stderr (no traceback) and return False."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"dpgrad: cannot write the {what} to {path}: {exc.strerror or exc}", file=sys.stderr)
        return False
    return True


def hf_overrides(parser: argparse.ArgumentParser, items: List[str]) -> dict:
    """``--hf-config KEY=VALUE`` items as config overrides (values read as JSON where they are)."""
    hf_config = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--hf-config {item!r}: write KEY=VALUE, e.g. num_hidden_layers=2")
        try:
            hf_config[key] = json.loads(value)
        except ValueError:
            hf_config[key] = value  # a plain string such as hidden_act=silu
    return hf_config
