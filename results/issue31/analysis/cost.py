"""The CPU-hours behind folders of runs: each line's wall time (its query, one thread), each stored index's build
time counted once however many runs or folders hold it (`indexes/*.json`: [FLOPs, 8B FLOPs, seconds, tokens]), and
`nodekv calibrate`'s sweeps where its log records their seconds (`*.sweeps.jsonl`; logs written before it did count
0 here). Wall times are on whatever machine and load ran them, so they count effort, not speed.

    python cost.py [runs ...]   # from results/issue31; default runs/, runs-calibrated/, superseded/; a markdown table
"""
import json
import sys
from pathlib import Path

from nodekv.evaluation.report import SWEEPS_SUFFIX

HERE = Path(__file__).resolve().parent.parent


def seconds(path: Path, key: str) -> float:
    return sum(json.loads(line).get(key, 0.0) for line in path.read_text().splitlines() if line.strip())


def hours(folder: Path, seen: set[str]) -> tuple[float, float, float]:
    """(hours of the lines, of the indexes not in `seen`, which then holds them, of the calibration sweeps)."""
    logs = [p for p in folder.glob("*.jsonl") if p.name.endswith(SWEEPS_SUFFIX)]
    lines = sum(seconds(p, "wall_s") for p in folder.glob("*.jsonl") if p not in logs)
    index = 0.0
    for p in sorted((folder / "indexes").glob("*.json")):
        if p.name not in seen:
            seen.add(p.name)
            index += json.loads(p.read_text())[2]
    return lines / 3600, index / 3600, sum(seconds(p, "seconds") for p in logs) / 3600


def main() -> None:
    folders = [HERE / a for a in sys.argv[1:]] or [HERE / "runs", HERE / "runs-calibrated", HERE / "superseded"]
    print("| folder | lines | indexes | calibration sweeps | total |")
    print("|---|---:|---:|---:|---:|")
    seen: set[str] = set()
    for folder in folders:
        if folder.is_dir():
            lines, index, sweeps = hours(folder, seen)
            print(f"| {folder.name} | {lines:.1f} | {index:.1f} | {sweeps:.1f} | {lines + index + sweeps:.1f} |")


if __name__ == "__main__":
    main()
