"""Drop the per-document GAT from saved GoR index files (its weights and trained_with), keeping the graph, the
vectors and the rankings; the JSON's tensor checksum and its own checksum are rewritten. Files being written now are
left alone (only those whose store entry exists)."""
import hashlib
import json
import sys
from pathlib import Path

from safetensors.torch import load_file
from safetensors.torch import save as to_bytes

from nodekv.methods.index_file import _checksum
from nodekv.paths import write_atomic

for entry in sorted(Path(sys.argv[1]).glob("gor-*.json")):
    idx = entry.with_suffix(".idx")
    side = Path(str(idx) + ".safetensors")
    tensors = load_file(str(side))
    if not any(k.startswith("gat.") for k in tensors):
        continue
    data = json.loads(idx.read_text())
    assert data.pop("checksum") == _checksum(data) and data["tensors_sha256"] == hashlib.sha256(side.read_bytes()).hexdigest()
    kept = to_bytes({k: v.contiguous() for k, v in tensors.items() if not k.startswith("gat.")})
    data["tensors_sha256"], data["trained_with"] = hashlib.sha256(kept).hexdigest(), None
    write_atomic(side, kept)
    write_atomic(idx, json.dumps({**data, "checksum": _checksum(data)}))
    print(idx.name, side.stat().st_size)
