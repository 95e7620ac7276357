"""Where a benchmark's result goes: a Markdown table, and with --json a dated JSON file.

The table goes to stdout; the JSON to docs/results/YYYY-MM-DD-NAME.json (today's date),
with a "host" record (host_info: CPU model, vector extensions, cores, library versions).

Every benchmark that produces numbers takes the same flag:
    --json          write docs/results/YYYY-MM-DD-NAME.json
    --json PATH     write PATH instead
    --json -        print the JSON as the last line of stdout (what tests read)
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

from benchmarks.host_info import host_info

RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "results"
DATED = "dated"  # --json without a value


def dated_path(name: str, day: datetime.date | None = None) -> Path:
    """docs/results/YYYY-MM-DD-NAME.json for today (or `day`)."""
    day = day or datetime.date.today()
    return RESULTS_DIR / f"{day:%Y-%m-%d}-{name}.json"


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        nargs="?",
        const=DATED,
        default=None,
        metavar="PATH",
        help="also write the result as JSON: docs/results/YYYY-MM-DD-NAME.json, PATH, "
        "or - for the last line of stdout",
    )


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):  # 4 significant digits, but never 1.024e+04 for a count
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value).replace("|", "\\|")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; floats to 4 significant digits, None as '-'."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def table_of_dicts(rows: list[dict]) -> str:
    """A Markdown table with one column per key (first seen first)."""
    header = list(dict.fromkeys(key for row in rows for key in row))
    return markdown_table(header, [[row.get(key) for key in header] for row in rows])


def publish(name: str, result: dict, table: str, destination: str | None) -> Path | None:
    """Print `table`, then write `result` where --json said (nothing without it)."""
    print(table, flush=True)
    return write_json(name, result, destination)


def write_json(name: str, result: dict, destination: str | None) -> Path | None:
    """`result` where --json said: the dated file, PATH, or stdout for '-'; with the host
    it was measured on (a result that brings its own "host" keeps it)."""
    if destination is None:
        return None
    result = {**result, "host": result.get("host") or host_info()}
    if destination == "-":
        print(json.dumps(result), flush=True)
        return None
    path = dated_path(name) if destination == DATED else Path(destination)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{name}: wrote {path}", file=sys.stderr)
    return path
