"""A tiny SVG line-plot writer with no dependencies (the benchmarks' figures; no matplotlib).

One plot: several named series of (x, y) points, each a polyline with dots, on linear or
logarithmic axes with ticks, grid lines, axis labels, a title and a legend. Optional dashed
horizontal reference lines (a goal, an ideal). The output is plain SVG 1.1 text: it renders on
GitHub and in any browser.

Example::

    from svgplot import line_plot
    svg = line_plot({"swarm": [(1, 2.3), (2, 2.5)], "star": [(1, 2.2), (2, 4.4)]},
                    title="time to reach N hosts", xlabel="hosts", ylabel="seconds")
    open("docs/plot.svg", "w").write(svg)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from html import escape

__all__ = ["COLORS", "line_plot", "nice_ticks"]

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_DASHES = ("", "6,3", "2,3", "8,3,2,3")


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("tick range must be finite")
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t < hi + step * 0.5:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten (and 2x, 5x where few decades) covering [lo, hi], lo > 0."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1, 2, 5) if b - a <= 3 else (1,)
    return [m * 10.0 ** e for e in range(a, b + 1) for m in mults if lo / 1.0001 <= m * 10.0 ** e <= hi * 1.0001] or [lo, hi]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4 or a < 1e-3:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{v:g}"


class _Axis:
    def __init__(self, values: Iterable[float], log: bool, lo_px: float, hi_px: float,
                 zero: bool, extra: Iterable[float] = ()) -> None:
        vals = [v for v in (*values, *extra) if v is not None and math.isfinite(v) and (v > 0 or not log)]
        if not vals:
            vals = [1.0, 10.0] if log else [0.0, 1.0]
        lo, hi = min(vals), max(vals)
        self.log = log
        if log:
            lo, hi = 10 ** math.floor(math.log10(lo) + 1e-9), 10 ** math.ceil(math.log10(hi) - 1e-9)
            if hi <= lo:
                hi = lo * 10
            self.ticks = _log_ticks(lo, hi)
            self.lo, self.hi = math.log10(lo), math.log10(hi)
        else:
            if zero:
                lo = min(0.0, lo)
            self.ticks = nice_ticks(lo, hi)
            self.lo, self.hi = self.ticks[0], self.ticks[-1]
        self.lo_px, self.hi_px = lo_px, hi_px

    def __call__(self, v: float) -> float:
        t = math.log10(v) if self.log else v
        return self.lo_px + (t - self.lo) / ((self.hi - self.lo) or 1.0) * (self.hi_px - self.lo_px)


def line_plot(series: Mapping[str, Sequence[tuple[float, float]]], *, title: str = "", xlabel: str = "",
              ylabel: str = "", logx: bool = False, logy: bool = False, hlines: Mapping[str, float] | None = None,
              xticks: Sequence[float] | None = None, width: int = 640, height: int = 400,
              note: str = "") -> str:
    """An SVG document (text) plotting each series of ``(x, y)`` points as a line with dots.

    ``hlines``: labelled dashed horizontal lines (e.g. ``{"ideal": 2.1}``). ``xticks``: the x
    ticks to label (default: chosen from the data). Points whose y is None are skipped. ``note``:
    a small line of text under the plot.
    """
    hlines = dict(hlines or {})
    left, right, top, bottom = 70, 20, 40 if title else 20, 60 if note else 48
    legend_w = 12 + 7 * max([len(k) for k in (*series, *hlines)] + [0]) + 26
    plot_r = width - right - legend_w
    xs = [x for pts in series.values() for x, y in pts if y is not None]
    ys = [y for pts in series.values() for _, y in pts if y is not None]
    ax = _Axis(list(xticks or []) + xs, logx, left, plot_r, zero=False)
    ay = _Axis(ys, logy, height - bottom, top, zero=not logy, extra=hlines.values())
    if xticks:
        ax.ticks = list(xticks)
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">'),
           f'<rect width="{width}" height="{height}" fill="white"/>']
    if title:
        out.append(f'<text x="{(left + plot_r) / 2:.1f}" y="22" text-anchor="middle" font-size="14" '
                   f'font-weight="bold">{escape(title)}</text>')
    y0, y1 = height - bottom, top
    for t in ay.ticks:  # grid and y labels
        y = ay(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{plot_r}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in ax.ticks:
        x = ax(t)
        out.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y1}" stroke="#f0f0f0"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + 16}" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<rect x="{left}" y="{y1}" width="{plot_r - left}" height="{y0 - y1}" fill="none" stroke="#444"/>')
    if xlabel:
        out.append(f'<text x="{(left + plot_r) / 2:.1f}" y="{y0 + 34}" text-anchor="middle">{escape(xlabel)}</text>')
    if ylabel:
        out.append(f'<text transform="translate(16,{(y0 + y1) / 2:.1f}) rotate(-90)" text-anchor="middle">'
                   f'{escape(ylabel)}</text>')
    if note:
        out.append(f'<text x="{left}" y="{height - 8}" font-size="10" fill="#555">{escape(note)}</text>')
    legend: list[tuple[str, str, str]] = []
    for i, (name, value) in enumerate(hlines.items()):
        y = ay(value)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{plot_r}" y2="{y:.1f}" stroke="#888" '
                   f'stroke-dasharray="{_DASHES[1 + i % 3]}"/>')
        legend.append((name, "#888", _DASHES[1 + i % 3]))
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        pts = sorted((x, y) for x, y in pts if y is not None and (not logy or y > 0))
        if len(pts) > 1:
            path = " ".join(f"{ax(x):.1f},{ay(y):.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in pts:
            out.append(f'<circle cx="{ax(x):.1f}" cy="{ay(y):.1f}" r="3.5" fill="{color}">'
                       f'<title>{escape(name)}: ({_fmt(x)}, {_fmt(y)})</title></circle>')
        legend.append((name, color, ""))
    lx = plot_r + 14
    for i, (name, color, dash) in enumerate(legend):
        y = top + 10 + 18 * i
        out.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 20}" y2="{y}" stroke="{color}" stroke-width="2"'
                   + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        out.append(f'<text x="{lx + 26}" y="{y + 4}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
