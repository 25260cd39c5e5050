"""`nodekv bench gpu_engine` refuses lengths that do not fit the preset's window, and unknown ways of summing node mass,
before it builds any model; a way that fails on the GPU costs its own row only."""
import pytest

from nodekv.bench import gpu_engine


@pytest.mark.parametrize("argv", [["--prompts", "512,2048"], ["--prompts", "0"], ["--decode", "600"]])
def test_lengths_beyond_the_window_are_refused_before_any_model(argv, monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built for arguments that should have been refused")

    monkeypatch.setattr(gpu_engine, "hf_model", no_model)
    with pytest.raises(SystemExit) as stop:
        gpu_engine.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "512", *argv])
    assert stop.value.code == 2
    assert "must fit tiny's 1024-token window" in capsys.readouterr().err


@pytest.mark.parametrize("ways, why", [
    ("kernel,dot", "'dot' is not kernel, sdpa or kernel/BMxBNxWARPSxSTAGES (e.g. kernel/64x32x4x2)"),
    ("sdpa/64x32x4x2", "'sdpa/64x32x4x2' is not kernel, sdpa or kernel/BMxBNxWARPSxSTAGES"),
    ("kernel/64x32x4", "'kernel/64x32x4': tiles must be (BLOCK_M, BLOCK_N, num_warps, num_stages)"),
    ("kernel/64x48x4x2", "'kernel/64x48x4x2': tiles must be"),
    ("kernel/64xbx4x2", "'kernel/64xbx4x2': tiles are four integers joined by x"),
])
def test_an_unknown_fresh_mass_is_refused_before_any_model(ways, why, monkeypatch, capsys):
    monkeypatch.setattr(gpu_engine, "hf_model", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as stop:
        gpu_engine.main(["--preset", "tiny", "--device", "cpu", "--fresh-mass", ways])
    assert stop.value.code == 2
    assert f"--fresh-mass: {why}" in capsys.readouterr().err


def test_each_way_is_the_engines_mass_settings_and_a_run_leaves_them_as_it_found_them(monkeypatch):
    """The ways as `triton_ops`' settings; `main`, which sets them for each way it times, restores them however it
    ends (a run inside a test's process must not leave its tiles to the tests after it)."""
    from nodekv.kernels import triton_ops

    assert [gpu_engine.mass_way(w) for w in ("kernel", "sdpa", "kernel/64x32x4x2")] == \
        [("kernel", None), ("sdpa", None), ("kernel", (64, 32, 4, 2))]
    before = triton_ops.FRESH_PREFILL_MASS, triton_ops.MASS_TILES

    def fails_mid_run(*args, **kwargs):  # as a way's timing would, once main has set its settings
        triton_ops.FRESH_PREFILL_MASS, triton_ops.MASS_TILES = "sdpa", (16, 16, 1, 1)
        raise RuntimeError("a failure mid-run")

    monkeypatch.setattr(gpu_engine, "hf_model", fails_mid_run)
    with pytest.raises(RuntimeError, match="a failure mid-run"):
        gpu_engine.main(["--preset", "tiny", "--device", "cpu", "--prompts", "96", "--fresh-mass", "kernel/16x16x1x1"])
    assert (triton_ops.FRESH_PREFILL_MASS, triton_ops.MASS_TILES) == before


def test_a_failing_way_leaves_a_row_and_a_cuda_fault_stops_the_run():
    """`or_failure`: a Python error becomes the row's text (the session's other rows still run); a CUDA fault, after
    which the device is unusable, is raised."""
    def raises(e: Exception):
        raise e

    assert gpu_engine.or_failure(lambda: 3) == 3
    assert gpu_engine.or_failure(lambda: raises(RuntimeError("no flash kernel\nmore"))) == \
        "failed: RuntimeError: no flash kernel"
    with pytest.raises(RuntimeError, match="CUDA error"):
        gpu_engine.or_failure(lambda: raises(RuntimeError("CUDA error: an illegal memory access")))
