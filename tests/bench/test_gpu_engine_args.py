"""`nodekv bench gpu_engine` refuses lengths that do not fit the preset's window, and unknown ways of summing node mass,
before it builds any model."""
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
