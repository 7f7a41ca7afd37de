"""Fuzz every parser of untrusted bytes for a time budget per target (``make fuzz``; issue 25).

The targets are those of ``tests/fuzz_targets.py`` (``tests/test_fuzz.py`` runs a few inputs of
each in ``make test``). For each target this prints the inputs tried, how many raised a package
error (or the documented ValueError of the low-level parsers), how many raised anything else (must
be 0: the first few are printed with their exception), and the largest peak of memory one input
allocated against its bound.

    python tools/fuzz.py --seconds 60                    # every target, 60 s each
    python tools/fuzz.py --seconds 10 --target patch     # the targets whose name contains "patch"
    python tools/fuzz.py --markdown out/fuzz.md --json out/fuzz.json   # also the table, and the run as JSON

(``tools/docgen.py fuzz out/fuzz.md --json out/fuzz.json`` puts the table into docs/benchmarks.md.)

Exits 1 when some input raised a non-package error or went over its memory bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import NonInteractiveExampleWarning  # noqa: E402

from benchlib import machine, write_outputs  # noqa: E402
from fuzz_targets import TARGETS, Target, describe, run_one  # noqa: E402

SHOW = 3  # failing inputs printed per target


@dataclass
class Report:
    name: str
    tried: int = 0
    package: int = 0
    other: int = 0
    over: int = 0  # inputs over their memory bound
    peak: int = 0  # the largest peak of one input
    peak_bound: int = 0  # that input's bound
    worst_ratio: float = 0.0  # the largest peak/bound of any input
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def fuzz(target: Target, seconds: float) -> Report:
    """Run ``target`` for about ``seconds``: hypothesis runs of fresh random inputs (generation only,
    nothing shrunk or replayed), as many as fit."""
    report = Report(target.name)
    t0 = time.monotonic()
    deadline = t0 + seconds

    def one(data: st.DataObject) -> None:
        inp = data.draw(target.strategy)
        got = run_one(target, inp)
        report.tried += 1
        if got.kind == "package":
            report.package += 1
        elif got.kind == "other":
            report.other += 1
            if len(report.failures) < SHOW:
                report.failures.append(f"{describe(got.error)}  <- {_short(inp)}")
        if got.peak > got.bound:
            report.over += 1
            if len(report.failures) < SHOW:
                report.failures.append(f"{got.peak} bytes allocated, bound {got.bound}  <- {_short(inp)}")
        if got.peak > report.peak:
            report.peak, report.peak_bound = got.peak, got.bound
        report.worst_ratio = max(report.worst_ratio, got.peak / got.bound)

    batch = 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        while time.monotonic() < deadline:
            started, before = time.monotonic(), report.tried
            run = lambda data: one(data)  # noqa: E731 - a fresh function: one settings object each
            given(data=st.data())(settings(max_examples=batch, deadline=None, database=None,
                                           phases=[Phase.generate], suppress_health_check=list(HealthCheck))(run))()
            rate = (report.tried - before) / max(time.monotonic() - started, 1e-3)
            batch = int(min(max(rate * min(5.0, deadline - time.monotonic()), 1), 2000))
    report.seconds = time.monotonic() - t0
    return report


def _short(inp: object) -> str:
    text = repr(inp)
    return text if len(text) <= 200 else f"{text[:160]}… ({len(text)} chars)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def markdown(reports: list[Report], seconds: float) -> str:
    lines = [
        f"Each target ran for {seconds:g} s (`python tools/fuzz.py --seconds {seconds:g}`). *Package errors*: "
        "inputs refused with a `ParamStoreError` (or the documented `ValueError` of `paramstore.format`); "
        "*other errors*: anything else (must be 0). *Peak*: the most one input allocated while parsed "
        "(tracemalloc), against that input's bound (2x the object it names + one 2 MiB chunk for patch "
        "frames and objects; 4 MiB + 8 bytes per byte of input for records, whose Python objects take several "
        "times their text); *worst*: the largest peak/bound of any input.",
        "",
        "| target | inputs | package errors | other errors | over bound | peak (its bound) | worst peak/bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        lines.append(f"| `{r.name}` | {r.tried:,} | {r.package:,} | {r.other} | {r.over} | "
                     f"{_mib(r.peak)} ({_mib(r.peak_bound)}) | {r.worst_ratio:.2f} |")
    total = sum(r.tried for r in reports)
    lines.append(f"| **all** | {total:,} | {sum(r.package for r in reports):,} | {sum(r.other for r in reports)} | "
                 f"{sum(r.over for r in reports)} | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="time budget per target (default 60)")
    ap.add_argument("--target", action="append", default=[], help="only targets whose name contains this")
    ap.add_argument("--markdown", metavar="FILE", help="also write the report as a markdown table")
    ap.add_argument("--json", metavar="FILE", help="also write the run (reports, machine) as JSON")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    targets = [t for t in TARGETS if not args.target or any(s in t.name for s in args.target)]
    reports = []
    for t in targets:
        r = fuzz(t, args.seconds)
        reports.append(r)
        print(f"{r.name:32} {r.tried:7,} inputs in {r.seconds:5.1f} s: {r.package:6,} package errors, "
              f"{r.other} other, {r.over} over bound; peak {_mib(r.peak)} (bound {_mib(r.peak_bound)}), "
              f"worst peak/bound {r.worst_ratio:.2f}", flush=True)
        for f in r.failures:
            print(f"    {f}", flush=True)
    res = {"argv": ["tools/fuzz.py", *(sys.argv[1:] if argv is None else argv)], "machine": machine(),
           "total_seconds": time.monotonic() - t0, "reports": [dataclasses.asdict(r) for r in reports]}
    write_outputs(args.json, res, args.markdown, markdown(reports, args.seconds))
    return 1 if any(r.other or r.over for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
