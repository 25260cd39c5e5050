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


def test_an_unknown_fresh_mass_is_refused_before_any_model(monkeypatch, capsys):
    monkeypatch.setattr(gpu_engine, "hf_model", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as stop:
        gpu_engine.main(["--preset", "tiny", "--device", "cpu", "--fresh-mass", "kernel,dot"])
    assert stop.value.code == 2
    assert "--fresh-mass: 'kernel,dot' is not kernel, sdpa or both" in capsys.readouterr().err


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
