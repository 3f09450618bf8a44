"""The last thing benchmarks/gpu_check.sh prints: at most 40 lines on what its stages did, from what they left
in OUTDIR (stages.tsv, tests.xml, the bench JSON rows), so that a run cut at a limit still says what it found.

    python benchmarks/gpu_check_summary.py OUTDIR
"""
import argparse
import collections
import glob
import json
import os
import xml.etree.ElementTree as ElementTree

MAX_LINES = 40
MAX_FAILURES = 20  # failing tests named, one line each; tests.log holds their tracebacks
LINE_WIDTH = 160
STOPPED_EXIT = (124, 137)  # timeout's "limit reached" (after SIGINT) and "killed" (SIGKILL 30 s later)


def stage_lines(out: str) -> list[str]:
    """One line per stage of stages.tsv: how it ended, its time and its limit."""
    lines = []
    path = os.path.join(out, "stages.tsv")
    for line in open(path, encoding="utf-8").read().split("\n") if os.path.exists(path) else []:
        if not line.strip():
            continue
        name, rc, seconds, limit = line.split()
        rc, seconds, limit = int(rc), int(seconds), int(limit)
        if rc in STOPPED_EXIT:
            how = f"STOPPED at its {limit} s limit"
        else:
            how = "ok" if rc == 0 else f"FAILED (exit {rc})"
        lines.append(f"{name:<7} {how}, {seconds} s (log: {name}.log)")
    return lines


def test_lines(out: str) -> list[str]:
    """The JUnit counts and the failing tests with the first line of their message."""
    path = os.path.join(out, "tests.xml")
    if not os.path.exists(path):
        return ["tests: no tests.xml (pytest wrote no JUnit XML)"]
    cases = ElementTree.parse(path).getroot().iter("testcase")
    outcome = collections.Counter()
    failures = []
    for case in cases:
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = any(c.tag == "skipped" for c in case)
        outcome["failed" if problem is not None else "skipped" if skipped else "passed"] += 1
        if problem is not None:
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            message = (problem.get("message") or problem.text or "").strip().split("\n")[0]
            failures.append(f"  {name}: {message}"[:LINE_WIDTH])
    lines = [f"tests: {sum(outcome.values())} ran: {outcome['passed']} passed, {outcome['failed']} failed, "
             f"{outcome['skipped']} skipped (tests.xml; tracebacks in tests.log)"]
    lines += failures[:MAX_FAILURES]
    if len(failures) > MAX_FAILURES:
        lines.append(f"  ... and {len(failures) - MAX_FAILURES} more failures (tests.xml)")
    return lines


def stage_rows(out: str, folder: str) -> list[dict]:
    """The rows a bench stage wrote under OUTDIR/folder."""
    return [row for path in sorted(glob.glob(os.path.join(out, folder, "*.json")))
            for row in json.load(open(path, encoding="utf-8"))]


def bench_lines(out: str) -> list[str]:
    """Per bench stage: its rows by status, and the first error; for the models stage, issue 25's targets that
    its rows measured, each met or not."""
    lines = []
    for folder in ("bench-models", "bench-ops"):
        rows = stage_rows(out, folder)
        if not rows:
            lines.append(f"{folder}: no rows")
            continue
        status = collections.Counter(row.get("status", "ok") for row in rows)
        lines.append(f"{folder}: {len(rows)} rows: " + ", ".join(f"{n} {s}" for s, n in sorted(status.items())))
        error = next((row for row in rows if row.get("status") in ("error", "oom")), None)
        if error is not None:
            lines.append(f"  first {error['status']}: {error.get('case')} [{error.get('provider')}]: "
                         f"{error.get('error')}"[:LINE_WIDTH])
        if folder == "bench-models":
            lines += target_lines(rows)
    return lines


def target_lines(rows: list[dict]) -> list[str]:
    """One line per issue 25 target these model rows measured, met or not; one line saying why where fastbert
    does not import (this summary reads the other stages' results with the standard library alone)."""
    try:  # gpu_check.sh runs this with the checkout on PYTHONPATH
        from fastbert.bench.report import model_targets
    except Exception as error:  # noqa: BLE001 - whatever broke the import, the summary's other lines stand
        return [f"  issue 25: not judged: fastbert.bench.report does not import ({error!r})"[:LINE_WIDTH]]
    return [f"  issue 25 {'met' if verdict[1] else 'NOT met'}: {text}: {verdict[0]}"[:LINE_WIDTH]
            for text, verdict in model_targets(rows, with_device=False) if verdict is not None]


def summary(out: str) -> list[str]:
    lines = [f"gpu_check summary ({out})", *stage_lines(out), *test_lines(out), *bench_lines(out)]
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES - 1] + [f"... {len(lines) - MAX_LINES + 1} more lines cut"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the OUTDIR given to benchmarks/gpu_check.sh")
    print("\n".join(summary(parser.parse_args().out)))


if __name__ == "__main__":
    main()
