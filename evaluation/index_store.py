"""Where evaluation keeps what it built: indexes of methods that can save them, one file per (document, method, model,
index key), with the FLOPs and time their construction cost, so a rerun or a resumed run does not rebuild them, and
two processes sharing a store (two `nodekv eval` or `index-corpus` runs, Ray workers) do not build one index twice."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from ..engine.config import preset
from ..engine.engine import Engine
from ..engine.flops import FlopAccount
from ..methods.base import Method
from ..paths import write_atomic

PROJECT_TO = "llama-3.1-8b"  # every FLOP count is also projected to this preset for the same token counts
# A builder touches its claim every CLAIM_BEAT_S; a claim untouched for CLAIM_STALE_S is taken to be a dead builder's
# (the only test across hosts; on the claim's own host a dead pid says so at once). WAIT_POLL_S: how often a process
# waiting for another's build looks again.
CLAIM_BEAT_S, CLAIM_STALE_S, WAIT_POLL_S = 30.0, 120.0, 5.0


def processed_tokens(acc: FlopAccount) -> int:
    """Tokens the model has run so far (prefill + decode; a forked cached prefix is not run again, so not counted)."""
    return acc.prefill_tokens + acc.decode_tokens


def document_hash(document: str) -> str:
    """A document's key in eval lines and index stores."""
    return hashlib.sha256(document.encode()).hexdigest()[:16]


class BuiltIndex(NamedTuple):
    """A document's index and what building it cost: FLOPs on the model and projected to PROJECT_TO, seconds, and
    tokens the model processed (prefill + decode; None for indexes stored before tokens were counted)."""

    index: Any
    flops: int
    flops_8b: int
    seconds: float
    tokens: int | None


class _Claim:
    """The right to build one index: a file created exclusively (`O_EXCL`, so one process of any number gets it)
    naming its holder's host and pid, touched by a daemon thread while the build runs, removed when it ends."""

    def __init__(self, path: Path):
        self.path, self._done = path, threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    @classmethod
    def take(cls, path: Path) -> "_Claim | None":
        """The claim at `path`, or None when another builder holds it."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return None
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
        return cls(path)

    @staticmethod
    def holder(path: Path) -> str | None:
        """Who holds the claim at `path` ("pid N on HOST"), or None when nobody does. A claim whose holder died (its
        pid gone on this host, or untouched for CLAIM_STALE_S) is removed. Two processes removing one stale claim
        at once can both go on to build: a race of a few microseconds after a crash, which costs a duplicate
        build, never a wrong index (indexes and costs are written atomically)."""
        try:
            age = time.time() - path.stat().st_mtime
            who = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # created, its holder not yet written: a live claim
            return "a process starting"
        host, pid = who.get("host"), who.get("pid")
        if age > CLAIM_STALE_S or (host == socket.gethostname() and not _alive(pid)):
            path.unlink(missing_ok=True)
            return None
        return f"pid {pid} on {host}"

    def _beat(self) -> None:
        while not self._done.wait(CLAIM_BEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def release(self) -> None:
        self._done.set()
        self.path.unlink(missing_ok=True)


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


class IndexStore:
    """Indexes of methods that can save them (`Method.can_save`), one file per (document, method, model, index
    key), with the FLOPs and time their construction cost: a rerun or resumed run does not rebuild them. Processes
    sharing a store build each index once: the first to claim a document builds it, the others wait for it."""

    def __init__(self, root: Path, key: str, engine: Engine):
        self.root, self.key, self.engine = root, key, engine
        # the costs it records are also projected (`BuiltIndex.flops_8b`), whoever builds through it
        engine.flops.project_to.setdefault(PROJECT_TO, preset(PROJECT_TO))

    @classmethod
    def for_method(cls, root: Path, engine: Engine, method: Method) -> "IndexStore":
        """The store of `method`'s indexes; only the options its index depends on (`method.index_key()`) enter
        the key, and the engine's precision where it is not the exact one and its KV dtype where it is not the
        model's (which the keys of older stores lack)."""
        ident = [str(engine.path), str(engine.model.dtype), method.name, method.index_key()]
        if engine.model.precision != "exact":
            ident.append(engine.model.precision)
        if engine.pool.dtype != engine.model.dtype:
            ident.append(f"kv {engine.pool.dtype}")
        ident = json.dumps(ident, sort_keys=True)
        return cls(root, f"{method.name}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}", engine)

    def build_or_load(self, method: Method, document: str) -> BuiltIndex:
        """`document`'s index and its cost, built (and saved) unless this store has it; construction is charged
        to the engine's "index" scope. With kv_reuse on, an index that the same root holds for kv_reuse=off only
        gets its nodes' KV stored (`Method.store_kv`: the same index as a build from the document), and its cost
        is that index's plus the storing's."""
        doc = document_hash(document)
        claim = self._stored_or_claim(method, doc)
        if isinstance(claim, BuiltIndex):
            return claim
        try:
            kv_free = self._kv_free(method, doc)
            acc = self.engine.flops
            before, before_8b, tokens, t = acc.total, acc.projected.get(PROJECT_TO, 0), processed_tokens(acc), \
                time.perf_counter()
            with acc.scope("index"):
                built = method.index(document) if kv_free is None else method.store_kv(kv_free.index)
            cost = (acc.total - before, acc.projected.get(PROJECT_TO, 0) - before_8b, time.perf_counter() - t,
                    processed_tokens(acc) - tokens)
            if kv_free is not None:
                cost = tuple(a + b if b is not None else None for a, b in zip(cost, kv_free[1:]))
            self.put(method, doc, built, cost)
        finally:
            if claim is not None:
                claim.release()
        return BuiltIndex(built, *cost)

    def _stored_or_claim(self, method: Method, doc: str) -> BuiltIndex | _Claim | None:
        """The stored index of the document hashed `doc` (waiting while another process builds it), or this
        process's claim to build it (None for a method that saves nothing, so has nothing to share)."""
        if not method.can_save:
            return None
        waiting = False
        while True:
            found = self.get(method, doc)  # loaded holding no claim, so a load that fails leaves none behind
            if found is not None:
                return found
            self.root.mkdir(parents=True, exist_ok=True)
            claim = _Claim.take(self._claim_path(doc))
            if claim is not None:
                if self.cost(doc) is None:
                    return claim
                claim.release()  # a build that ended between the look and the claim: load it
                continue
            holder = _Claim.holder(self._claim_path(doc))
            if holder is not None:
                if not waiting:
                    print(f"waiting for {holder}, which is building the index {self.index_path(doc)}",
                          file=sys.stderr)
                    waiting = True
                time.sleep(WAIT_POLL_S)

    def builder(self, doc: str) -> str | None:
        """Who is building the index of the document hashed `doc` now ("pid N on HOST"), or None when nobody is."""
        return _Claim.holder(self._claim_path(doc))

    def _claim_path(self, doc: str) -> Path:
        return self.root / f"{self.key}-{doc}.building"

    def _kv_free(self, method: Method, doc: str) -> BuiltIndex | None:
        """The saved kv_reuse=off index of the document hashed `doc`, when `method` stores KV and this root has it."""
        if getattr(method.config, "kv_reuse", "off") == "off" or not method.can_save:
            return None
        off = copy.copy(method)
        off.config = replace(method.config, kv_reuse="off")
        return IndexStore.for_method(self.root, self.engine, off).get(off, doc)

    def build_cost(self, method: Method, document: str) -> tuple | str:
        """What building (or finding) `document`'s index cost (BuiltIndex's fields after the index), or the error
        that stopped it as "Type: message", so that a corpus goes on past one bad document."""
        try:
            return tuple(self.build_or_load(method, document))[1:]
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def index_path(self, doc: str) -> Path:
        """Where the index of the document hashed `doc` is (or would be) saved."""
        return self.root / f"{self.key}-{doc}.idx"

    def cost(self, doc: str) -> tuple | None:
        """What building the stored index of the document hashed `doc` cost (BuiltIndex's fields after the index),
        or None if this store does not have it."""
        meta = self.root / f"{self.key}-{doc}.json"
        if not meta.exists():
            return None
        cost = json.loads(meta.read_text())
        return (*cost, *[None] * (4 - len(cost)))

    def get(self, method: Method, doc: str):
        cost = self.cost(doc) if method.can_save else None
        return None if cost is None else BuiltIndex(method.load_index(self.index_path(doc)), *cost)

    def put(self, method: Method, doc: str, built, cost: tuple) -> None:
        if method.can_save:
            self.root.mkdir(parents=True, exist_ok=True)
            method.save_index(built, self.index_path(doc))
            # the cost file marks the index complete, so it is written last and whole: a process killed before
            # this leaves a document that the next run builds again
            write_atomic(self.root / f"{self.key}-{doc}.json", json.dumps(cost))
