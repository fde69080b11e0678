"""Progress on a terminal: a load's weights get a bar once the load has taken
LOAD_BAR_AFTER_S, quick loads print nothing, and the bar goes when the load ends."""

from __future__ import annotations

import io
import time

import pytest
from helpers import cli

from cuda_runner.cli import progress
from cuda_runner.cli.progress import TerminalProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_quick_load_shows_nothing(monkeypatch):
    monkeypatch.setattr(progress, "LOAD_BAR_AFTER_S", 0.5)
    stream = Terminal()
    with TerminalProgress(stream, None) as bars:
        bars.load("forward", 0, 100)
        bars.load("forward", 100, 100)
        time.sleep(0.6)  # the timer was cancelled: no bar appears afterwards either
        assert bars._progress is None
    assert stream.getvalue() == ""


def test_a_slow_load_shows_its_bytes_until_it_ends(monkeypatch):
    monkeypatch.setattr(progress, "LOAD_BAR_AFTER_S", 0.05)
    stream = Terminal()
    with TerminalProgress(stream, None) as bars:
        bars.load("decode", 0, 4_000_000_000)
        time.sleep(0.3)
        bars.load("decode", 1_000_000_000, 4_000_000_000)
        assert bars._progress is not None and "decode" in bars._load
        bars.load("decode", 4_000_000_000, 4_000_000_000)
        assert bars._progress is None and not bars._load  # nothing left to show: the display is gone
    assert "loading decode" in stream.getvalue()


def test_run_shows_a_slow_loads_bar_on_a_terminal(compiled, tmp_path, monkeypatch):
    from cuda_runner.cli import main
    from cuda_runner.runtime import method

    terminal = Terminal()
    monkeypatch.setattr(main._Terminal, "stderr", classmethod(lambda cls: terminal))
    monkeypatch.setattr(progress, "LOAD_BAR_AFTER_S", 0.05)
    feed = method._load_weights

    def slow_load(*args):
        time.sleep(0.3)
        feed(*args)

    monkeypatch.setattr(method, "_load_weights", slow_load)
    bundle = compiled("linear", "cpu").path
    result = cli("run", str(bundle), "--random-inputs", "--out-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "loading forward" in terminal.getvalue()


@pytest.mark.parametrize("quiet", [["-q"], []])
def test_run_shows_no_bar_off_a_terminal_or_when_quiet(compiled, tmp_path, monkeypatch, quiet):
    from cuda_runner.cli import main

    stream = Terminal() if quiet else io.StringIO()
    monkeypatch.setattr(main._Terminal, "stderr", classmethod(lambda cls: stream))
    monkeypatch.setattr(progress, "LOAD_BAR_AFTER_S", 0.0)
    result = cli(*quiet, "run", str(compiled("linear", "cpu").path), "--random-inputs", "--out-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "loading forward" not in stream.getvalue()


def test_nothing_shows_once_the_display_is_closed(monkeypatch):
    monkeypatch.setattr(progress, "LOAD_BAR_AFTER_S", 0.0)
    stream = Terminal()
    with TerminalProgress(stream, None) as bars:
        pass
    bars.load("late", 0, 100)
    time.sleep(0.1)
    assert bars._progress is None and not bars._timers
