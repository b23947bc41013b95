"""The dashboard's colours: a colour-blind-safe palette, one colour per series on the whole
page, and the check that every two colours of one chart can be told apart.

Colours are compared as CIEDE2000 differences in CIELAB (D65), as seen with normal vision and
as simulated for deuteranopia and protanopia (Machado, Oliveira and Fernandes 2009, severity
1.0, applied to linear sRGB). The page records each chart's colours in its DOM, so the test
in Chromium runs the same check on what was drawn.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, Iterable, List, Sequence, Tuple

# Okabe and Ito's colours, then Paul Tol's: every two of these thirteen differ by at least
# MIN_DELTA_E in each of the three views below, and each from the white page by 15 or more.
# Left out: Okabe and Ito's black and Tol's pale grey #DDDDDD (7 from white). Black hides the
# error bars drawn over it and, as a thin bar, reads like the other dark colours (readers of
# an earlier page could not tell it from a dark brown, 17.6 apart under protanopia).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7", "#F0E442",
           "#332288", "#AA3377", "#EE6677", "#994455", "#99DDFF", "#EE99AA")
BACKGROUND = "#FFFFFF"

# A CIEDE2000 difference of about 1 is the smallest two large patches side by side show, and
# 2 to 5 reads as "similar" for patches apart. A reader matches a thin bar with a small legend
# swatch across the chart, where small fields need several times the large-field difference,
# so two series of one chart must differ by 10 or more in every view; the palette clears it
# (its closest pair: 10.0, green and rose under protanopia).
MIN_DELTA_E = 10.0

# Machado et al. (2009), severity 1.0: linear RGB -> linear RGB as the dichromat sees it.
CVD = {
    "deuteranopia": ((0.367322, 0.860646, -0.227968),
                     (0.280085, 0.672501, 0.047413),
                     (-0.011820, 0.042940, 0.968881)),
    "protanopia": ((0.152286, 1.052583, -0.204868),
                   (0.114503, 0.786281, 0.099216),
                   (-0.003882, -0.048116, 1.051998)),
}
VIEWS = ("normal", "deuteranopia", "protanopia")

Lab = Tuple[float, float, float]


def _linear(hex_colour: str) -> Tuple[float, float, float]:
    text = hex_colour.strip().lstrip("#")
    if len(text) == 3:
        text = "".join(c * 2 for c in text)
    if len(text) != 6:
        raise ValueError(f"{hex_colour!r} is not a colour: write #RRGGBB")
    channels = [int(text[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    return tuple(c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)


def _lab(rgb: Sequence[float]) -> Lab:
    """CIELAB (D65 white) of a linear-sRGB colour."""
    r, g, b = rgb
    x = (0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047
    y = 0.2126729 * r + 0.7151522 * g + 0.0721750 * b
    z = (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116

    fx, fy, fz = f(x), f(y), f(z)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def lab(hex_colour: str, view: str = "normal") -> Lab:
    """CIELAB of ``#RRGGBB`` as seen in ``view`` (one of ``VIEWS``)."""
    rgb = _linear(hex_colour)
    if view != "normal":
        m = CVD[view]
        rgb = tuple(min(1.0, max(0.0, sum(m[i][j] * rgb[j] for j in range(3)))) for i in range(3))
    return _lab(rgb)


def ciede2000(lab1: Lab, lab2: Lab) -> float:
    """The CIEDE2000 colour difference (kL = kC = kH = 1), after Sharma, Wu and Dalal (2005)."""
    l1, a1, b1 = lab1
    l2, a2, b2 = lab2
    c_mean = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_mean ** 7 / (c_mean ** 7 + 25 ** 7)))
    a1, a2 = (1 + g) * a1, (1 + g) * a2
    c1, c2 = math.hypot(a1, b1), math.hypot(a2, b2)
    h1 = math.degrees(math.atan2(b1, a1)) % 360 if c1 else 0.0
    h2 = math.degrees(math.atan2(b2, a2)) % 360 if c2 else 0.0
    dh = 0.0
    if c1 * c2:
        dh = h2 - h1
        dh = dh - 360 if dh > 180 else dh + 360 if dh < -180 else dh
    d_l, d_c = l2 - l1, c2 - c1
    d_h = 2 * math.sqrt(c1 * c2) * math.sin(math.radians(dh / 2))
    l_mean, c_mean = (l1 + l2) / 2, (c1 + c2) / 2
    if not c1 * c2:
        h_mean = h1 + h2
    elif abs(h1 - h2) <= 180:
        h_mean = (h1 + h2) / 2
    else:
        h_mean = (h1 + h2 + 360) / 2 if h1 + h2 < 360 else (h1 + h2 - 360) / 2
    t = (1 - 0.17 * math.cos(math.radians(h_mean - 30)) + 0.24 * math.cos(math.radians(2 * h_mean))
         + 0.32 * math.cos(math.radians(3 * h_mean + 6)) - 0.20 * math.cos(math.radians(4 * h_mean - 63)))
    rotation = 30 * math.exp(-(((h_mean - 275) / 25) ** 2))
    r_c = 2 * math.sqrt(c_mean ** 7 / (c_mean ** 7 + 25 ** 7))
    s_l = 1 + 0.015 * (l_mean - 50) ** 2 / math.sqrt(20 + (l_mean - 50) ** 2)
    s_c, s_h = 1 + 0.045 * c_mean, 1 + 0.015 * c_mean * t
    r_t = -math.sin(math.radians(2 * rotation)) * r_c
    return math.sqrt((d_l / s_l) ** 2 + (d_c / s_c) ** 2 + (d_h / s_h) ** 2 + r_t * (d_c / s_c) * (d_h / s_h))


def difference(colour1: str, colour2: str, view: str = "normal") -> float:
    """CIEDE2000 between two ``#RRGGBB`` colours as seen in ``view``."""
    return ciede2000(lab(colour1, view), lab(colour2, view))


def pair_problems(colours: Dict[str, str], minimum: float = MIN_DELTA_E,
                  background: str = BACKGROUND) -> List[str]:
    """Every pair of ``colours`` (series -> ``#RRGGBB``), and each colour against the
    ``background``, closer than ``minimum`` in any of the three views, said in words; empty
    when every pair can be told apart."""
    named = dict(colours)
    if background:
        named["the background"] = background
    problems = []
    for (s1, c1), (s2, c2) in itertools.combinations(named.items(), 2):
        for view in VIEWS:
            d = difference(c1, c2, view)
            if d < minimum:
                problems.append(f"{s1} ({c1}) and {s2} ({c2}): CIEDE2000 {d:.1f} < {minimum:g} ({view})")
    return problems


def assign(charts: Iterable[Sequence[str]], palette: Sequence[str] = PALETTE) -> Dict[str, str]:
    """One colour per series for a page whose charts show ``charts`` (each a list of series):
    the same in every chart and never shared by two series of one chart. Charts with more
    series choose first, each new series taking the first palette colour its chart-mates do not
    have, so the busiest charts get Okabe and Ito's colours; two series that never share a
    chart may share a colour. A chart of more series than the palette has colours repeats one,
    and ``pair_problems`` names the pair."""
    charts = [list(dict.fromkeys(c)) for c in charts]
    colour_of: Dict[str, str] = {}
    for chart in sorted(charts, key=len, reverse=True):
        for series in chart:
            if series in colour_of:
                continue
            mates = {colour_of[s] for c in charts if series in c for s in c if s in colour_of}
            free = [c for c in palette if c not in mates]
            colour_of[series] = free[0] if free else palette[len(colour_of) % len(palette)]
    return colour_of
