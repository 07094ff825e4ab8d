"""Write docs/reliability.md's table from the fault suite's measurements (never by hand).

    RELIABILITY_RESULTS=/tmp/rel.jsonl python -m pytest tests/reliability -q
    python tools/reliability_table.py /tmp/rel.jsonl            # rewrites the table between the markers
"""

import json
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
BEGIN, END = "<!-- table: begin (tools/reliability_table.py) -->", "<!-- table: end -->"


def main(results: str) -> None:
    rows = [json.loads(line) for line in Path(results).read_text().splitlines() if line.strip()]
    table = ["| case | what the user sees | time to exit (s) | processes left | test |", "|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['case']} | {r['sees']} | {r['exit_s']} | {r['left']} | `{r['test']}` |")
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    DOC.write_text(head + BEGIN + "\n" + "\n".join(table) + "\n" + END + tail)


if __name__ == "__main__":
    main(sys.argv[1])
