"""Where nodekv finds what lives beside its code rather than in it: the source checkout (examples, results) and the
evaluation data. Defaults resolve from the checkout, or from the current folder outside one; nothing is ever
written inside the installed package. Also how nodekv reads and writes files: documents checked before any model
work, every file written atomically (`atomic_path`, `write_atomic`), JSON-lines logs read back after a kill
(`read_json_lines`); and the checkout's root kept off sys.path (`keep_checkout_off_sys_path`)."""
from __future__ import annotations

import glob
import json
import os
import re
import secrets
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DATA_ENV = "NODEKV_DATA_DIR"


def _is_checkout(folder: Path) -> bool:
    project = folder / "pyproject.toml"
    return project.is_file() and 'name = "nodekv"' in project.read_text(errors="replace")


def checkout() -> Path | None:
    """The nodekv source checkout: the folder above this package when it is one (an editable install), else the
    current folder or the nearest one above it that is; None outside any."""
    here = Path(__file__).resolve().parents[1]
    if _is_checkout(here):
        return here
    cwd = Path.cwd().resolve()
    return next((p for p in (cwd, *cwd.parents) if _is_checkout(p)), None)


def keep_checkout_off_sys_path() -> None:
    """Take the source checkout's root off sys.path, in this process and (PYTHONSAFEPATH, Python >= 3.11) in the
    Python children it starts. `python -m` and `python -c` run in the checkout put its root first on sys.path, where
    its package folders (engine/, kernels/, ...: nodekv's subpackages through pyproject's package-dir) hide installed
    packages of the same names, such as the `kernels` that transformers 5.x imports. nodekv is installed (editable in
    a checkout), so the root is not needed."""
    root = Path(__file__).resolve().parents[1]
    if _is_checkout(root):
        sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != root]
        os.environ["PYTHONSAFEPATH"] = "1"


def base() -> Path:
    """The checkout, or the current folder outside one: where relative defaults (results/, build/) go."""
    return checkout() or Path.cwd()


def results_dir(*parts: str) -> Path:
    """results/<parts> of the checkout (or of the current folder)."""
    return base().joinpath("results", *parts)


def data_dir() -> Path:
    """The evaluation data: $NODEKV_DATA_DIR, else ../shared/data beside the checkout (or the current folder)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return (base() / ".." / "shared" / "data").resolve()


def example(name: str) -> Path:
    """A file of the checkout's examples/ (the benchmarks read its story; outside a checkout, ./examples/)."""
    return base() / "examples" / name


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary path in `path`'s folder for the whole file to be written to, renamed onto `path` with
    os.replace (atomic on one file system) once the block ends, after an fsync, and deleted if the block raises. A
    crash or a kill mid-write leaves the previous file whole under its name, never a partial one. The temporary
    name is hidden and ends in .tmp, so that no glob for `path`'s kind of file finds one a kill left behind (a
    writer that reads the format from the suffix must be told it); a later write of `path` removes it once stale."""
    path = Path(path)
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name[:200]}.{os.getpid()}-{secrets.token_hex(4)}.tmp")  # within NAME_MAX
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # 0o666 less the umask, as open()
    except OSError as e:  # named by the path asked for, not the hidden temporary
        _check_folder(path.parent)
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


STALE_TEMPORARY_S = 3600  # a temporary unchanged this long, of a process gone, is what a kill left


def _remove_stale_temporaries(path: Path) -> None:
    """Delete the temporaries of `path` that writers killed mid-write left behind (a model assembly's is ~1 GB):
    those whose process is gone and that have not changed for `STALE_TEMPORARY_S` (the age guards a writer on
    another machine sharing the folder, whose process id means nothing here)."""
    for tmp in path.parent.glob(f".{glob.escape(path.name[:200])}.*.tmp"):
        writer = re.fullmatch(r"(\d+)-[0-9a-f]{8}\.tmp", tmp.name[len(path.name[:200]) + 2:])
        if writer is None:
            continue
        try:
            os.kill(int(writer.group(1)), 0)
            continue  # the writer runs (or runs as another user)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, ValueError):
            continue
        try:
            if time.time() - tmp.stat().st_mtime > STALE_TEMPORARY_S:
                tmp.unlink()
        except OSError:  # removed meanwhile by another writer, or not ours to remove
            pass


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` whole or not at all (`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


class NotUTF8Error(ValueError):
    """A text file that is not UTF-8: the message names the file, the first bad byte and its offset, and how to
    convert the file; `byte` and `offset` are those."""

    def __init__(self, path: Path, byte: int, offset: int):
        self.byte, self.offset = byte, offset
        super().__init__(f"{path} is not UTF-8 text (byte 0x{byte:02x} at offset {offset}); convert it, e.g. "
                         f"iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}")


def read_text(path: str | os.PathLike) -> str:
    """`path`'s text (UTF-8 without a leading byte-order mark, newlines as `Path.read_text` reads them), or a
    NotUTF8Error."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        try:
            path.read_bytes().decode("utf-8")  # again as a whole: the error's offset is then the file's
        except UnicodeDecodeError as e:
            raise NotUTF8Error(path, e.object[e.start], e.start) from None
        raise


def check_input(path: str | os.PathLike, what: str) -> Path:
    """`path` if it is an existing file, else a ValueError naming `what` it should be (e.g. "document")."""
    path, article = Path(path), "an" if what[0] in "aeiou" else "a"
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not {article} {what} file")
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} is a device, a pipe or a socket, not {article} {what} file")
    return path


def _check_folder(folder: Path, lead: str = "the output folder ") -> None:
    if not folder.exists():
        raise ValueError(f"{lead}{folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{lead}{folder} is a file, not a folder")
    try:  # a file made and removed: permission bits do not bind root, and a read-only or virtual file system
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".nodekv-", suffix=".tmp")  # refuses only here
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{lead}{folder} is not writable ({e.strerror})") from None


def check_output_file(path: str | os.PathLike) -> Path:
    """`path` if a file can be written there, else a ValueError naming the problem (its folder missing, not a
    folder or not writable; `path` a directory): checked before any work, so that a typo costs no build."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"the output {path} is a directory, not a file")
    _check_folder(path.parent)
    return path


def check_output_folder(path: str | os.PathLike) -> Path:
    """`path` if it is a writable folder, or one that can be made in an existing folder (missing folders are made
    one level deep: a path deeper into nowhere is more likely a typo), else a ValueError naming the problem."""
    path = Path(path)
    if path.exists():
        _check_folder(path)
    else:
        _check_folder(path.parent, f"cannot make the output folder {path}: ")
    return path


def read_json_lines(path: str | os.PathLike, cut_torn_tail: bool = False) -> list[dict]:
    """The lines of a JSON-lines file appended to as work finishes (a run file, a calibration's sweeps). A last line
    without its newline is torn (its writer was killed mid-line): it is left out and, for the writer resuming
    (`cut_torn_tail`), cut off the file in place, every other byte kept. Readers never write. Any other line that
    is not a JSON object is a ValueError naming the file and the line: nothing is dropped from the middle. A
    missing file has none."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    *lines, tail = data.split(b"\n")  # tail: b"" when the file ends with its newline
    good = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:  # JSON or UTF-8
            raise ValueError(f"{path}, line {number}, is not JSON ({e}): mend or remove that line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {number}, is a JSON {type(row).__name__}, not an object")
        good.append(row)
    if tail.strip() and cut_torn_tail:
        os.truncate(path, len(data) - len(tail))  # one call: a kill leaves the torn line or none, never less
    return good
