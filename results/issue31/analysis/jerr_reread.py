"""Whether JERR's re-read pages explain its accuracy on QuALITY: its questions split by whether the model asked to
re-read a page in full, with each group's raw accuracy under JERR, full context, BM25 Top-X matched to JERR and
closed book. If the rows that never see JERR's choice (full context, closed book) rise between the groups as much as
JERR does, the groups differ in difficulty, not in what the re-read gave.

    python jerr_reread.py            # from results/issue31; prints a markdown table
"""
import json
from pathlib import Path

RUNS = Path(__file__).resolve().parent.parent / "runs"
ROWS = [("JERR", "jerr"), ("full context", "full"), ("BM25 Top-X matched to JERR", "bm25-topx-jerr"),
        ("closed book", "closed-book")]


def load(stem: str) -> dict[str, dict]:
    lines = (RUNS / f"{stem}-quality.jsonl").read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, filter(str.strip, lines))}


def main() -> None:
    runs = {stem: load(stem) for _, stem in ROWS}
    groups = {False: [], True: []}
    for qid, r in runs["jerr"].items():
        groups[bool(r["trace"][0]["reread"])].append(qid)
    print("| questions | n | " + " | ".join(name for name, _ in ROWS) + " |")
    print("|---|---:|" + "---:|" * len(ROWS))
    for reread, ids in groups.items():
        cells = [f"{100 * sum(runs[stem][i]['metrics']['accuracy'] for i in ids) / len(ids):.1f}" for _, stem in ROWS]
        print(f"| {'a page re-read' if reread else 'none re-read'} | {len(ids)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
