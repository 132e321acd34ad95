"""Fails CI unless the quickstart that README command 1 just ran cut every teacher's held-out
divergence by at least 30% (issue 6, item 1)."""

import json
import sys
from pathlib import Path

records = [
    json.loads(line) for line in Path("mopd-quickstart/quickstart-run/metrics.jsonl").read_text().splitlines()
]
evals = [r for r in records if r.get("split") == "eval"]
before, after = evals[0]["divergence_by_teacher"], evals[-1]["divergence_by_teacher"]
changes = {t: after[t] / before[t] - 1 for t in before}
print("quickstart held-out divergence change by teacher:", {t: f"{c:+.1%}" for t, c in changes.items()})
sys.exit(0 if len(changes) == 2 and all(c <= -0.30 for c in changes.values()) else 1)
