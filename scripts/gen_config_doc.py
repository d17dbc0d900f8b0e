"""Regenerate the "All settings" tables of docs/configuration.md from `Settings`.

Usage: python scripts/gen_config_doc.py [--check]

Everything from the `## All settings` heading to the end of the file is generated: one
table per settings group, in field order, with the flag, the variable, the default and
the help text. The prose above the heading is written by hand. `--check` fails when the
file differs from what would be generated (CI runs it through `make lint`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from enum import Enum
from pathlib import Path

from rerank_server.settings import Settings, env_name, flag_name

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
HEADING = "## All settings"
INTRO = (
    "Generated from `rerank_server/settings.py` by `make docs` "
    "(`scripts/gen_config_doc.py`); do not edit by hand."
)


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "`on`" if value else "`off`"
    if isinstance(value, Enum):
        return f"`{value.value}`"
    if isinstance(value, Path):
        return "`~/.cache/rerank-server`"  # the default follows XDG_CACHE_HOME
    if value == "":
        return "(empty)"
    return f"`{value}`"


def tables() -> str:
    defaults = Settings()
    groups: dict[str, list[str]] = {}
    for f in dataclasses.fields(Settings):
        row = (
            f"| `{flag_name(f.name)}` | `{env_name(f.name)}` | "
            f"{_shown(getattr(defaults, f.name))} | {f.metadata['help']} |"
        )
        groups.setdefault(f.metadata["group"], []).append(row)
    parts = [HEADING, "", INTRO]
    for group, rows in groups.items():
        parts += [
            "",
            f"### {group}",
            "",
            "| flag | variable | default | meaning |",
            "|---|---|---|---|",
            *rows,
        ]
    return "\n".join(parts) + "\n"


def render(current: str) -> str:
    head, found, _ = current.partition(HEADING)
    if not found:
        raise SystemExit(f"{DOC}: no '{HEADING}' heading")
    return head + tables()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the doc is stale")
    args = parser.parse_args()
    current = DOC.read_text()
    wanted = render(current)
    if args.check:
        if current != wanted:
            print(f"{DOC.relative_to(ROOT)} is stale: run `make docs`", file=sys.stderr)
            return 1
        print("configuration doc is up to date")
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
