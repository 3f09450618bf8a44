"""Which measured rows stand: a case's rows from the newest run that measured it.

A run is the rows sharing one date (one `fastbert bench` command). A GPU session with a few minutes measures a
few cases (`--only`), so "the newest run" alone would drop every case an older, fuller run measured. Instead each
case keeps the rows of the newest run in which one of its rows is "ok", all of that run's rows for the case and
nothing of other runs, so providers are only ever compared within one run (one machine, one warm-up). A case
no run measured keeps the rows (skipped or failed) of the newest run that has it, which say why.
"""
from __future__ import annotations


def newest_per_case(rows: list[dict]) -> list[dict]:
    """rows (one suite on one device or architecture) -> the rows that stand: measured cases first, newest run
    first, then the cases no run measured, each from the newest run that has it."""
    by_run: dict[str, list[dict]] = {}
    for row in rows:
        by_run.setdefault(row["date"], []).append(row)
    kept, taken = [], set()
    for measured_only in (True, False):
        for date in sorted(by_run, reverse=True):
            run = by_run[date]
            cases = {r["case"] for r in run if r["status"] == "ok" or not measured_only} - taken
            kept += [r for r in run if r["case"] in cases]
            taken |= cases
    return kept


def first_rows(rows: list[dict]) -> dict[str, dict]:
    """{date: the first row of that run}, newest run first: what a run's provenance is read from."""
    firsts: dict[str, dict] = {}
    for row in rows:
        firsts.setdefault(row["date"], row)
    return dict(sorted(firsts.items(), reverse=True))


def run_labels(rows: list[dict]) -> dict[str, str]:
    """{date: "a", "b", ...} newest first, when the rows come from more than one run; else {}."""
    dates = list(first_rows(rows))
    return {date: chr(ord("a") + i) for i, date in enumerate(dates)} if len(dates) > 1 else {}
