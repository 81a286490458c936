"""The GPU check's one results file: every section appends records, the last step folds them into one JSON.

Each section (``gpu_check.py``, ``gpu_strategies.py``, ``gpu_check_vllm.py``, ``gpu_check_sglang.py``) calls
``log(out, record)``: a dict with ``check`` and ``status`` (``ok``, ``FAILED`` or ``skipped``, with ``why``),
printed and appended to ``out/gpu_check.jsonl`` as it happens, so a section cut short by its timeout
still leaves what it measured. ``python gpu_check/gpu_records.py OUT`` writes ``OUT/gpu_check.json``:
the records, and per status the checks that had it; it exits 1 if any check failed or none but the
environment record passed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STATUSES = ("ok", "FAILED", "skipped")


def log(out: Path, record: dict) -> None:
    """Print ``record`` and append it to ``out/gpu_check.jsonl``; ``status`` must be one of ``STATUSES``."""
    if record.get("status") not in STATUSES:
        raise ValueError(f"a GPU check record needs a status in {STATUSES}: {record}")
    print(json.dumps(record), flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def fold(out: Path) -> dict:
    """``out/gpu_check.jsonl`` as one JSON document (written to ``out/gpu_check.json``)."""
    lines = (Path(out) / "gpu_check.jsonl").read_text().splitlines() if (Path(out) / "gpu_check.jsonl").exists() else []
    records = [json.loads(line) for line in lines if line.strip()]
    summary = {status: [r["check"] for r in records if r.get("status") == status] for status in STATUSES}
    report = {"summary": summary, "records": records}
    (Path(out) / "gpu_check.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    report = fold(Path(sys.argv[1]))
    counts = {status: len(checks) for status, checks in report["summary"].items()}
    print(f"gpu_check.json: {counts}; failed: {report['summary']['FAILED']}")
    ran = [check for check in report["summary"]["ok"] if check != "environment"]
    sys.exit(1 if report["summary"]["FAILED"] or not ran else 0)
