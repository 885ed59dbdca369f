"""Corruption fixture: damage a real store in each known way and record what castore does.

The cases, and the stores they damage, are castore.testing.corrupt; what is
observed of each (load, live targets, verify, fallbacks) and how it is judged,
castore.testing.corrupt_report. This prints one row per case.

A case whose outcome is wrong in a way castore is known to mishandle is listed
with the reason in ``Case.gaps``: it prints XFAIL; if it starts to behave it
prints XPASS and fails the run, so the gap list cannot go stale.

    python tools/corrupt.py [--store DIR] [--case NAME ...] [--json OUT]

Exit status: 0 when every case is PASS or XFAIL, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from castore.testing.corrupt import CASES, CASES_BY_NAME
from castore.testing.corrupt_report import run_case, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, help="directory for the stores (default: a temp dir)")
    parser.add_argument("--case", nargs="+", choices=sorted(CASES_BY_NAME), help="cases to run")
    parser.add_argument("--json", type=Path, help="write every outcome to this JSON file")
    args = parser.parse_args(argv)
    cases = [CASES_BY_NAME[name] for name in args.case] if args.case else list(CASES)

    started = time.perf_counter()
    base = args.store or Path(tempfile.mkdtemp(prefix="castore-corrupt-"))
    try:
        outcomes = [run_case(case, base / case.name) for case in cases]
    finally:
        if args.store is None:
            shutil.rmtree(base, ignore_errors=True)
    elapsed = time.perf_counter() - started

    print(table(cases, outcomes))
    for case, outcome in zip(cases, outcomes, strict=True):
        for aspect, found in outcome.failures.items():
            label = "known gap" if aspect in case.gaps else "FAILED"
            for line in found:
                print(f"{outcome.case} [{aspect}] {label}: {line}")
    counts = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "XFAIL", "XPASS", "FAIL")}
    print(
        f"{len(outcomes)} case(s) in {elapsed:.1f}s: "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    )
    if args.json:
        payload = [dataclasses.asdict(outcome) for outcome in outcomes]
        args.json.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    return 1 if counts["FAIL"] or counts["XPASS"] else 0


if __name__ == "__main__":
    sys.exit(main())
