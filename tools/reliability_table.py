"""Write docs/reliability.md's table from the fault suite's measurements (never by hand).

    RELIABILITY_RESULTS=/tmp/rel.jsonl python -m pytest tests/reliability -q
    python tools/reliability_table.py /tmp/rel.jsonl            # rewrites the table between the markers

A measured row replaces the table's row of the same test; rows of tests that were not run are kept, so a run of
part of the suite (pytest -k ...) updates only its rows. Pass --only to write the measured rows alone.
"""

import argparse
import json
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
BEGIN, END = "<!-- table: begin (tools/reliability_table.py) -->", "<!-- table: end -->"
HEADER = ["| case | what the user sees | time to exit (s) | processes left | test |", "|---|---|---|---|---|"]


def test_of(row: str) -> str:
    return row.rstrip().rstrip("|").rsplit("|", 1)[-1].strip().strip("`")


def main(results: str, only: bool = False) -> None:
    measured = {}
    for line in Path(results).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            measured[r["test"]] = f"| {r['case']} | {r['sees']} | {r['exit_s']} | {r['left']} | `{r['test']}` |"
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    old, tail = rest.split(END)
    kept = [] if only else [row for row in old.strip().splitlines()[len(HEADER):] if row.startswith("|")]
    rows = [measured.pop(test_of(row), row) for row in kept] + list(measured.values())
    DOC.write_text(head + BEGIN + "\n" + "\n".join(HEADER + rows) + "\n" + END + tail)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="the jsonl file RELIABILITY_RESULTS named")
    parser.add_argument("--only", action="store_true", help="drop the rows of tests not in the results")
    args = parser.parse_args()
    main(args.results, args.only)
