"""The CPU-hours behind a folder of runs: each line's wall time (its query, one thread) plus each stored index's
build time, counted once however many runs load it (`indexes/*.json`: [FLOPs, 8B FLOPs, seconds, tokens]).
Wall times are on whatever machine and load ran them, so they count effort, not speed.

    python cost.py [runs ...]        # from results/issue31; default runs/ and superseded/; prints a markdown table
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def hours(folder: Path) -> tuple[float, float]:
    """(hours of the lines, hours of the indexes) under `folder`."""
    lines = 0.0
    for path in folder.glob("*.jsonl"):
        lines += sum(json.loads(line).get("wall_s", 0.0) for line in path.read_text().splitlines() if line.strip())
    index = sum(json.loads(p.read_text())[2] for p in (folder / "indexes").glob("*.json"))
    return lines / 3600, index / 3600


def main() -> None:
    folders = [HERE / a for a in sys.argv[1:]] or [HERE / "runs", HERE / "superseded"]
    print("| folder | lines | indexes | total |")
    print("|---|---:|---:|---:|")
    for folder in folders:
        if folder.is_dir():
            lines, index = hours(folder)
            print(f"| {folder.name} | {lines:.1f} | {index:.1f} | {lines + index:.1f} |")


if __name__ == "__main__":
    main()
