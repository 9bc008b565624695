"""The progress bar: live on a terminal (tqdm when importable, else a plain bar), one line per item when redirected."""

from __future__ import annotations

import io
import sys

import pytest

from refmla.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(stream, n=3):
    p = Progress(n, stream=stream)
    for i in range(n):
        p.step(f"cap{i}.safetensors")
    p.close()
    return p


def test_redirected_output_gets_one_line_per_item():
    out = io.StringIO()
    p = run(out)
    assert not p.live
    assert out.getvalue().splitlines() == [f"[{i + 1}/3] cap{i}.safetensors" for i in range(3)]


def test_a_terminal_gets_a_live_bar_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    out = Terminal()
    p = run(out)
    assert p.live
    text = out.getvalue()
    assert "\r[" in text and "3/3" in text and text.endswith("\n")
    assert "[1/3] cap0" not in text  # not the redirected form


def test_a_terminal_gets_tqdm_when_it_is_there():
    pytest.importorskip("tqdm")
    out = Terminal()
    p = run(out)
    assert p.live and p._bar is not None
    assert "3/3" in out.getvalue()


def test_one_item_prints_nothing():
    out = Terminal()
    run(out, n=1)
    assert out.getvalue() == ""
