#!/usr/bin/env bash
# Issue 31's runs still to finish, as two lanes of one process each (one thread: a 2-core machine runs both lanes).
# Every step resumes where its files stop, and a finished step only reloads the model and exits, so a lane is
# restarted from its first step whatever the last session reached. Run from the checkout's root, with the nodekv of
# a worktree pinned to a commit (so that code moved meanwhile cannot touch a running process):
#
#   git worktree add --detach ../wt-eval HEAD && (cd ../wt-eval && python3 -m venv .venv && \
#     echo "$PWD/../main/.venv/lib/python3.11/site-packages" > .venv/lib/python3.11/site-packages/main.pth && \
#     .venv/bin/pip install -q --no-deps --no-build-isolation -e .)
#   NODEKV=../wt-eval/.venv/bin/nodekv nohup bash results/issue31/resume.sh a > lane-a.log 2>&1 &
#   NODEKV=../wt-eval/.venv/bin/nodekv nohup bash results/issue31/resume.sh b > lane-b.log 2>&1 &
#
# Lane a: QuALITY, then GoR's Multi-News indexes; lane b: the multi-hop sets, then GoR's row, which shares the indexes
# still to build with lane a (they meet in the middle), so that both lanes end about together.
# Commit the run files as they land. A step refused (a resumed file written under other settings) prints why and the
# lane goes on to the next step.
set -u
lane=${1:?"usage: resume.sh a|b"}
NODEKV=${NODEKV:-nodekv}
R=results/issue31
E="$NODEKV eval --model qwen2.5-1.5b --threads 1 --out $R/runs"

gor_indexes() {  # records 10-29 of Multi-News as text files, the far end first (index-corpus goes in name order)
    local dir=${TMPDIR:-/tmp}/issue31-gor-docs
    mkdir -p "$dir"
    "$(dirname "$NODEKV")/python" - "$dir" <<'EOF'
import sys
from nodekv.evaluation.datasets import load_dataset
records = load_dataset("multi_news").records
for i in range(10, 30):
    with open(f"{sys.argv[1]}/{99 - i}.txt", "w") as f:
        f.write(records[i].document)
EOF
    $NODEKV index-corpus "$dir" --method gor --option alpha=0.7 --option dropout=0.1 --model qwen2.5-1.5b --threads 1 \
        --out $R/runs/indexes
}

cheaper_than_full() {  # whether run file $1 reads fewer query FLOPs a record than full context on dataset $2
    "$(dirname "$NODEKV")/python" - "$1" "$R/runs/full-$2.jsonl" <<'EOF'
import json, sys
mean = [sum(r["query_flops"] for r in rows) / len(rows)
        for rows in ([json.loads(line) for line in open(path) if line.strip()] for path in sys.argv[1:])]
sys.exit(0 if mean[0] < mean[1] else 1)
EOF
}

calibrated_pecan() {  # t_p chosen on records 40-49 in a folder of its own, so the paper-settings rows keep theirs
    local ds=$1 out=$R/runs-calibrated
    mkdir -p $out/indexes && cp -n $R/runs/indexes/pecan-* $out/indexes/
    $NODEKV calibrate --dataset "$ds" --dev-start 40 --dev 10 --objective f1 --model qwen2.5-1.5b --threads 1 --out $out
    $NODEKV eval --model qwen2.5-1.5b --threads 1 --out $out --method pecan --label pecan-calibrated --dataset "$ds" \
        --limit 40
}

case $lane in
a)
    $E --method pecan --dataset quality
    $E --method jerr --option read=pages --dataset quality  # JERR's fix attempt: raw pages instead of synopses
    $E --method bm25 --match $R/runs/jerr-quality.jsonl --label bm25-topx-jerr --dataset quality
    $E --method dense --match $R/runs/jerr-quality.jsonl --label dense-topx-jerr --dataset quality
    $E --method bm25 --match $R/runs/pecan-quality.jsonl --label bm25-topx-pecan --dataset quality
    $E --method dense --match $R/runs/pecan-quality.jsonl --label dense-topx-pecan --dataset quality
    gor_indexes  # from record 29 down, while lane b's GoR row builds them from record 10 up
    $E --method full --dataset multi_news --limit 30
    $E --method gor --option rank=fused --dataset multi_news --limit 30
    # last: JERR's fix scored below JERR itself (40.0% against 43.8%), so its own matched row decides nothing
    $E --method bm25 --match "$R/runs/jerr-read=pages-quality.jsonl" --label bm25-topx-jerr-pages --dataset quality
    $E --method bm25 --k 3 --dataset quality  # the low end of QuALITY's Top-X curve (the matched runs are k = 7, 13)
    ;;
b)
    fix="--method dice --option notes=false --option rerank=false"
    $E $fix --dataset musique --limit 40
    $E $fix --dataset 2wikimqa --limit 40
    for ds in musique hotpotqa 2wikimqa; do  # Top-X matched to DICE's fix where it reads less than full context
        fixed="$R/runs/dice-notes=False-rerank=False-$ds.jsonl"
        cheaper_than_full "$fixed" $ds || continue
        for m in bm25 dense; do $E --method $m --match "$fixed" --label $m-topx-dice-fix --dataset $ds --limit 40; done
    done
    $E --method dice --dataset 2wikimqa --limit 40
    $E --method dice --dataset musique --limit 40
    $E --method dice --option algorithm=1 --dataset 2wikimqa --limit 40
    $E --method dice --option algorithm=1 --dataset musique --limit 40
    calibrated_pecan hotpotqa
    calibrated_pecan musique
    calibrated_pecan 2wikimqa
    for k in 1 3 5 8; do  # the Top-X curves over k (2WikiMQA's k = 5 is bm25-topx-pecan's)
        for ds in musique 2wikimqa; do
            [ "$k$ds" = 52wikimqa ] || $E --method bm25 --k $k --dataset $ds --limit 40
        done
    done
    $E --method bm25 --k 8 --dataset hotpotqa --limit 40
    # GoR's row builds the Multi-News indexes lane a's gor_indexes has not reached (each is built once: a store
    # loads an index another process finished meanwhile), then its matched Top-X rows
    $E --method gor --dataset multi_news --limit 30
    $E --method bm25 --match $R/runs/gor-multi_news.jsonl --label bm25-topx-gor --dataset multi_news --limit 30
    $E --method dense --match $R/runs/gor-multi_news.jsonl --label dense-topx-gor --dataset multi_news --limit 30
    $E --method bm25 --k 3 --dataset multi_news --limit 30  # Multi-News's Top-X curve beside the matched k = 6
    $E --method closed-book --dataset multi_news --limit 30  # Multi-News's floor, as the other sets have theirs
    ;;
*)
    echo "resume.sh: lane must be a or b, got '$lane'" >&2
    exit 2
    ;;
esac
