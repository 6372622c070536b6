"""Run a fuzz campaign against ember and print what happened (issue 13).

    python benchmarks/fuzz_report.py [--cases N] [--start K] [--seed S] [--json F]
                                     [--timeout SEC] [--mem BYTES] [--workers W]

Cases K .. K+N-1 of base seed S (tests/fuzz_mutants.py: the first ids of every campaign pin
each mutation kind and each named variant once), each loaded and run in a worker subprocess
under an address-space cap and a timeout, with the same runner as tests/tools/test_fuzz.py. Prints
the counts per outcome, per mutation kind, the distinct failure signatures (python_error:
type and the innermost frame, with the innermost ember frame; killed/hung: the signal or
timeout and where the stack was) with an example case each, and the EmberErrors that wrap a
plain Python exception. --json writes every case's result.

Reproduce a case: python tests/fuzz_worker.py --case ID [--base-seed S]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import fuzz_mutants as fm  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=2000, help="number of cases (default 2000)")
    p.add_argument("--start", type=int, default=0, help="first case id (default 0)")
    p.add_argument("--seed", type=int, default=0, help="base seed (default 0, the test's corpus)")
    p.add_argument("--json", metavar="FILE", help="write every case's result as JSON")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per case (default 20)")
    p.add_argument("--mem", type=int, default=3 << 30, help="address-space cap per worker, bytes")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)

    done = [0]
    t0 = time.monotonic()

    def progress(result):
        done[0] += 1
        if not args.quiet and (done[0] % 100 == 0 or result.outcome not in fm.ACCEPTED):
            note = "" if result.outcome in fm.ACCEPTED else \
                f"  case {result.case_id}: {result.outcome} {result.signature[:100]}"
            print(f"[{done[0]}/{args.cases} {time.monotonic() - t0:.0f}s]{note}",
                  file=sys.stderr, flush=True)

    ids = range(args.start, args.start + args.cases)
    results = fm.run_cases(ids, timeout_s=args.timeout, mem_bytes=args.mem, workers=args.workers,
                           base_seed=args.seed, progress=progress)
    seconds = time.monotonic() - t0
    print(f"fuzz campaign: cases {args.start}..{args.start + args.cases - 1}, base seed "
          f"{args.seed}, {args.workers} workers, timeout {args.timeout:g} s, cap "
          f"{args.mem / 2 ** 30:.1f} GiB: {seconds:.0f} s")
    print(fm.summarize(results))
    bad = [r for r in results if r.outcome not in fm.ACCEPTED]
    if bad:
        print()
        print(fm.failure_table(bad, limit=10 ** 6))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": args.cases, "start": args.start, "seed": args.seed,
                       "seconds": seconds, "results": [dataclasses.asdict(r) for r in results]},
                      f, indent=1)
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
