"""bench/gpu_check.sh's summary: every phase's status and results in one JSON, and the table.

    python -m bench.gpu_summary --phases OUT/phases.tsv --work WORK --output-json OUT/summary.json

Reads the phase table the script wrote (name, status, exit code, seconds, limit, note) and
whatever each phase left in WORK (env.json, gpu_tests.xml, hf_equiv.xml, kv.json,
attention.json, serve.json; a missing or unreadable one is null), and sets the figures
beside the issue's targets. Imports no torch: it runs even where nothing else did.
Exit status 0 when no phase failed, timed out or ran out of time.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BAD_STATUSES = ("failed", "timeout", "no_time")


@dataclass(frozen=True)
class Phase:
    name: str
    status: str  # ok | failed | timeout | no_time | skipped
    exit_code: int | None
    seconds: int
    limit_s: int
    note: str


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None  # None: not measured in this run
    target: float
    met: bool | None


def read_phases(path: Path) -> list[Phase]:
    phases = []
    for line in path.read_text().splitlines():
        name, status, rc, seconds, limit, note = (line.split("\t") + [""] * 6)[:6]
        phases.append(Phase(name, status, int(rc) if rc.lstrip("-").isdigit() else None,
                            int(seconds or 0), int(limit or 0), note))
    return phases


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests / failures / errors / skipped of a pytest --junitxml file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _row(kv: Any, transport: str) -> dict[str, Any] | None:
    rows = kv.get("rows", []) if isinstance(kv, dict) else []
    return next((r for r in rows if r.get("transport") == transport and "error" not in r), None)


def _decode(serve: Any, batch: int) -> dict[str, Any] | None:
    rows = serve.get("decode", []) if isinstance(serve, dict) else []
    return next((r for r in rows if r.get("batch") == batch), None)


def _get(d: dict[str, Any] | None, key: str) -> float | None:
    return None if d is None or d.get(key) is None else float(d[key])


def targets(kv: Any, attention: Any, serve: Any) -> list[Target]:
    """The issue's targets for an H200 (issue 21), from this run's figures."""
    b1, b32 = _decode(serve, 1), _decode(serve, 32)
    prefill = serve.get("prefill") if isinstance(serve, dict) else None
    att = attention.get("result") if isinstance(attention, dict) else None
    pairs = [
        ("decode batch 1, fraction of the HBM roofline", _get(b1, "fraction"), 0.70),
        ("decode batch 1, tok/s", _get(b1, "tokens_per_s"), 210.0),
        ("decode batch 32, tok/s", _get(b32, "tokens_per_s"), 5000.0),
        ("prefill at 2,048 tokens, fraction of bf16 peak", _get(prefill, "fraction_of_peak"), 0.40),
        ("CUDA IPC KV transfer, fraction of device memcpy", _get(_row(kv, "cuda"), "ratio"), 0.50),
        ("Triton decode attention speed-up over gather + SDPA", _get(att, "speedup"), 3.0),
    ]
    return [Target(n, v, t, None if v is None else v >= t) for n, v, t in pairs]


def summarize(phases: list[Phase], work: Path) -> dict[str, Any]:
    kv, attention, serve = (_json(work / f) for f in ("kv.json", "attention.json", "serve.json"))
    return {
        "schema_version": 1,
        "ok": not any(p.status in BAD_STATUSES for p in phases),
        "phases": [asdict(p) for p in phases],
        "env": _json(work / "env.json"),
        "tests": {n: junit_counts(work / f"{n}.xml") for n in ("gpu_tests", "hf_equiv")},
        "kv_transfer": kv,
        "attention": attention,
        "serve": serve,
        "targets": [asdict(t) for t in targets(kv, attention, serve)],
    }


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'phase':<10} {'status':<8} {'exit':>5} {'s':>5} {'limit':>6}  note")
    for p in summary["phases"]:
        rc = "-" if p["exit_code"] is None else p["exit_code"]
        print(f"{p['name']:<10} {p['status']:<8} {rc:>5} {p['seconds']:>5} {p['limit_s']:>6}  "
              f"{p['note']}")
    print(f"\n{'target':<52} {'value':>9} {'target':>8}  met")
    for t in summary["targets"]:
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        print(f"{t['name']:<52} {_fmt(t['value']):>9} {_fmt(t['target']):>8}  {met}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--output-json", required=True, type=Path)
    args = ap.parse_args(argv)
    summary = summarize(read_phases(args.phases), args.work)
    args.output_json.write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
