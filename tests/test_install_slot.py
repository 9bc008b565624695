"""The install-once helper both hooks share (refmla.hook.postimport.InstallSlot): one installation,
the finder first on sys.meta_path, every original back on uninstall, a patcher's error never raised."""

from __future__ import annotations

import sys
import types

from refmla.hook.postimport import InstallSlot


class _State:
    def __init__(self):
        self.failures = []

    def fail(self, e):
        self.failures.append(str(e))


def test_install_once_patch_and_restore(tmp_path):
    mod = types.ModuleType("refmla_slot_target")
    mod.f = original = lambda: "original"
    sys.modules[mod.__name__] = mod
    slot, made = InstallSlot(), []

    def patch(m):  # runs at once: the module is imported already; sees the installation
        slot.current.module_attrs.append((m, "f", m.f))
        m.f = lambda: "patched"

    try:
        first = slot.install(str(tmp_path / "out"), lambda: made.append(1) or _State(), lambda: {mod.__name__: patch}, slot.fail)
        again = slot.install(str(tmp_path / "other"), lambda: made.append(2) or _State(), lambda: {}, slot.fail)
        assert again is first and made == [1] and not (tmp_path / "other").exists()
        assert (tmp_path / "out").is_dir() and sys.meta_path[0] is first.finder and mod.f() == "patched"
        slot.uninstall()
        assert mod.f is original and first.finder not in sys.meta_path and slot.current is None and slot.state is None
    finally:
        slot.uninstall()
        sys.modules.pop(mod.__name__, None)


def test_a_patcher_error_disables_never_raises(tmp_path):
    mod = types.ModuleType("refmla_slot_broken")
    sys.modules[mod.__name__] = mod
    slot = InstallSlot()

    def broken(m):
        raise RuntimeError("no such class")

    try:
        inst = slot.install(str(tmp_path), _State, lambda: {mod.__name__: broken}, slot.fail)
        assert inst.state.failures == ["no such class"]
    finally:
        slot.uninstall()
        sys.modules.pop(mod.__name__, None)
    slot.fail(RuntimeError("after uninstall"))  # nothing installed: a no-op, not an AttributeError
