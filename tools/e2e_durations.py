"""Record the e2e items' durations from a run's JUnit XML into ``tests/e2e_durations.json``.

    python tools/e2e_durations.py runs/e2e.xml [more.xml ...]

The CI share of the e2e tier (tests/support/e2e_shard.py) balances its shards by these figures. Items in the
XML replace their old figures, items not in it keep theirs; JUnit's time is set-up + call + tear-down, so a
module's shared fixture counts on the item that built it. Rounded to whole seconds, sorted, so a rerun on a
machine of the same kind changes few lines.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "e2e_durations.json"


def nodeid(case: ET.Element) -> str:
    """pytest's node id of a JUnit test case (``classname`` is the dotted module path, plus the class)."""
    parts = case.get("classname", "").split(".")
    # the module is the longest prefix that is a file: tests/e2e/test_x.py[::Class]
    for i in range(len(parts), 0, -1):
        path = Path(*parts[:i]).with_suffix(".py")
        if (OUT.parents[1] / path).exists():
            return "::".join([path.as_posix(), *parts[i:], case.get("name", "")])
    raise ValueError(f"no test module for {case.get('classname')!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("xml", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    durations = json.loads(a.out.read_text()) if a.out.exists() else {}
    n = 0
    for x in a.xml:
        for case in ET.parse(x).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                continue
            durations[nodeid(case)] = round(float(case.get("time", 0)))
            n += 1
    a.out.write_text(json.dumps(dict(sorted(durations.items())), indent=1) + "\n")
    print(
        f"{n} durations from {len(a.xml)} file(s) -> {a.out} ({len(durations)} items, {sum(durations.values()) / 60:.1f} min)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
