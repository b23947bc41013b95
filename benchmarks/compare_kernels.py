"""Two bench_kernels runs side by side (``gpu_session.sh kernels-compare``): each dpgrad row of
the base beside the same shape and provider of the head, and the head's ratios to cuBLAS and
to the roofline measured in its run.

    python benchmarks/compare_kernels.py BASE_DIR HEAD_DIR
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Dict, Tuple

from dpgrad.tools import results


def _rows(folder: str) -> Dict[Tuple, dict]:
    out = {}
    for doc in results.load(sorted(Path(folder).glob("kernels_*.json"))):
        for r in doc["results"]:
            s = r["shape"]
            out[(s["kernel"], s["layer"], s["T"], s["B"], r["provider"])] = r
    return out


def _p50(row, name):
    if row is None or row.get("status") != "ok" or name not in row["metrics"]:
        return math.nan
    return row["metrics"][name]["p50"]


def main(base_dir: str, head_dir: str) -> None:
    base, head = _rows(base_dir), _rows(head_dir)
    for key, r in head.items():
        if key[0] == "roofline" and r.get("status") == "ok":
            m = r["metrics"]
            what = f"{_p50(r, 'tensor_flops'):.3g} TFLOP/s" if "tensor_flops" in m else f"{_p50(r, 'bandwidth'):.3g} GB/s"
            print(f"head roofline: {r['provider']} {what}")
    print(f"{'kernel':19} {'layer':22} {'T':>5} {'B':>3} {'provider':20} {'base ms':>9} {'head ms':>9} {'head/base':>9}"
          f" {'/GEMM':>7} {'/Gram':>7} {'/read':>7} {'roofline':>8}")
    ratios: Dict[str, list] = {}
    for key in sorted(head, key=lambda k: tuple(str(x) for x in k)):
        kernel, layer, T, B, provider = key
        if not provider.startswith("dpgrad"):
            continue
        h, b = head[key], base.get(key)
        th, tb = _p50(h, "time"), _p50(b, "time")
        if th == th and tb == tb:
            ratios.setdefault(f"{kernel} {provider}", []).append(th / tb)
        print(f"{kernel:19} {layer:22} {T!s:>5} {B!s:>3} {provider:20} {tb:9.3f} {th:9.3f} {th / tb:9.3f}"
              f" {_p50(h, 'time_over_gemm'):7.2f} {_p50(h, 'time_over_cublas_gram'):7.2f}"
              f" {_p50(h, 'time_over_read'):7.2f} {_p50(h, 'roofline_fraction'):8.1%}")
    for name, values in sorted(ratios.items()):
        mean = math.exp(sum(math.log(v) for v in values) / len(values))
        print(f"{name}: head/base geometric mean {mean:.3f} over {len(values)} shapes")


if __name__ == "__main__":
    main(*sys.argv[1:3])
