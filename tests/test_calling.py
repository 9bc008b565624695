"""Finding a kernel across module paths: the reason given is the first real cause, not a side effect."""

import sys
import textwrap

import pytest

from refmla.backends.calling import KernelNotFound, find_function

MISSING = "refmla_test_missing_dependency"  # a third-party module nobody has installed


def write(path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def fakepkg(tmp_path, monkeypatch):
    """SGLang 0.5.23's layout in small: the package's __init__ imports a namespace subpackage
    (no __init__.py), one module of which needs a missing third-party module. The failed import
    leaves the namespace subpackage in sys.modules without its parent."""
    root = tmp_path / "refmla_fakepkg"
    write(root / "__init__.py", "from refmla_fakepkg.srt import environ\nfrom refmla_fakepkg.srt.utils import x\n")
    write(root / "srt" / "environ.py")
    write(root / "srt" / "utils.py", f"import {MISSING}\nx = 1\n")
    write(root / "kernels" / "__init__.py")
    write(root / "kernels" / "decode.py", "def decode_fwd():\n    pass\n")
    write(root / "srt" / "layers" / "__init__.py")
    write(root / "srt" / "layers" / "decode.py", "def decode_fwd():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "refmla_fakepkg"
    for name in [m for m in sys.modules if m.split(".")[0] == "refmla_fakepkg"]:
        del sys.modules[name]


@pytest.mark.parametrize("imported_before", [False, True])
def test_every_path_reports_the_missing_third_party_module(fakepkg, imported_before):
    if imported_before:  # as the triton backend's availability check does before the extend one looks
        with pytest.raises(ModuleNotFoundError):
            __import__(fakepkg)
    paths = (f"{fakepkg}.kernels.decode", f"{fakepkg}.srt.layers.decode")  # new path first, then the old one
    with pytest.raises(KernelNotFound) as err:
        find_function(paths, "decode_fwd", "the fake kernel")
    msg = str(err.value)
    first, second = msg.split("; ")
    assert first.startswith(f"the fake kernel not found: {paths[0]}: import failed") and MISSING in first
    assert "KeyError" not in msg, f"a side effect of the first failed import was reported as a cause: {msg}"
    assert second.startswith(f"{paths[1]}: import failed") and (MISSING in second or "same" in second), msg
    orphans = [m for m in sys.modules if m.startswith(fakepkg + ".")]
    assert not orphans, f"half-imported modules left behind: {orphans}"


def test_a_path_that_imports_is_found_after_one_that_does_not_exist(tmp_path, monkeypatch):
    write(tmp_path / "refmla_fakepkg2" / "__init__.py")
    write(tmp_path / "refmla_fakepkg2" / "old.py", "def fwd():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fn, where = find_function(("refmla_fakepkg2.new", "refmla_fakepkg2.old"), "fwd", "fwd")
        assert where == "refmla_fakepkg2.old" and fn.__name__ == "fwd"
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "refmla_fakepkg2"]:
            del sys.modules[name]
