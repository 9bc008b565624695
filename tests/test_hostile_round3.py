"""Issue 33: the third round of hostile inputs, one test per class this branch closes. Each test
plants its example with its own code and checks the promise: the exit code, one stderr line naming
the file and the key or tensor, memory under the stated budget (VmHWM), every other capture's report.

    meta numbers     every numeric meta key of every kind: type, finiteness, range (refmla.capture.numbers)
    block tables     their positions bounded (refmla.blocktable.MAX_POSITIONS), memory following them
    one bad capture  its own report, serial and --jobs; the others' reports all there
    one document     stdout under --json parses as one JSON document, every command, mixed folders
    leftovers        signals reap the isolation child; an interrupted golden generate keeps the
                     manifest; --layers / --ranks bounded; file names that are not UTF-8; long ints
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import MEASURE_ENV, ROOT, raw_write
from hostile import default_signals, error_lines, run_cli, small_capture, write_small
from test_signals import session_members, wait_for
from refmla.blocktable import MAX_POSITIONS
from refmla.capture.numbers import META_NUMBERS

BAD = "\0bad"  # a placeholder replaced by raw JSON text (1e400, a 4,401-digit integer) in the meta


def write_meta_text(path, t: dict, m: dict) -> Path:
    """Write with the meta's BAD value spliced in as raw JSON text (json.dumps cannot write 1e400)."""
    key, text = m.pop(BAD)
    raw_write(path, t, json.dumps(m)[:-1] + f", {json.dumps(key)}: {text}}}")
    return Path(path)


def one_error(err: str, *needles: str) -> str:
    lines = error_lines(err)
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def sparse_tensors(path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["meta"])


@pytest.fixture(scope="module")
def sparse_good(tmp_path_factory) -> Path:
    """A small clean V4 window-only sparse capture (refmla's synth writes the container)."""
    from refmla.sparse.make import synth_sparse

    path = tmp_path_factory.mktemp("sparse") / "sparse_good.safetensors"
    synth_sparse(path, "deepseek-v4-flash-tp8-swa")
    return path


# --- 1. meta numbers, every kind ---------------------------------------------------------------


def _out_of_range(key: str):
    typ, lo, hi = META_NUMBERS[key]
    return (hi * 10 if hi < 2**63 - 1 else 2**63) if typ is float or hi < 2**63 - 1 else lo - 1


@pytest.fixture(scope="module")
def dense_base() -> tuple[dict, dict]:
    return small_capture()


def test_every_numeric_meta_key_is_bounded_on_a_dense_capture(tmp_path, dense_base):
    for i, (key, text) in enumerate((key, text) for key in sorted(META_NUMBERS)
                                    for text in ["1e400", "-1e400", json.dumps(_out_of_range(key)), '"7"', "true"]):  # fmt: skip
        t, m = dense_base[0], json.loads(json.dumps(dense_base[1]))
        m.pop(key, None)
        m[BAD] = (key, text)
        path = write_meta_text(tmp_path / f"c{i}.safetensors", t, m)
        code, out, err = run_cli("replay", str(path), "--backend", "reference")
        assert code == 2, (key, text, err)
        one_error(err, str(path), f"meta key '{key}'")


def test_aiter_num_kv_splits_inf_is_refused_not_judged(tmp_path):
    t, m = small_capture()
    m.update(backend="aiter", aiter_path="persistent")
    m[BAD] = ("aiter_num_kv_splits", "1e400")
    path = write_meta_text(tmp_path / "aiter.safetensors", t, m)
    for cmd in ("replay", "inspect"):
        code, out, err = run_cli(cmd, str(path))
        assert code == 2
        one_error(err, str(path), "meta key 'aiter_num_kv_splits'", "finite")


@pytest.mark.parametrize("key", ["layer_id", "an_unknown_key"])
def test_a_4401_digit_meta_int_is_refused_naming_the_key(tmp_path, key):
    t, m = small_capture()
    m.pop(key, None)
    m[BAD] = (key, "9" * 4401)
    path = write_meta_text(tmp_path / "long.safetensors", t, m)
    for cmd in ("replay", "inspect"):
        code, out, err = run_cli(cmd, str(path))
        assert code == 2
        one_error(err, str(path), f"meta key '{key}'")


@pytest.mark.parametrize("key,text", [("compress_ratio", "1e400"), ("softmax_scale", "1e400"), ("page_size", "1e400"),
                                      ("window", "9" * 4401), ("layer_id", "-1")])  # fmt: skip
def test_sparse_meta_numbers_are_bounded_too(tmp_path, sparse_good, key, text):
    t, m = sparse_tensors(sparse_good)
    m.pop(key, None)
    m[BAD] = (key, text)
    path = write_meta_text(tmp_path / "sparse_bad.safetensors", t, m)
    code, out, err = run_cli("replay", str(path))
    assert code == 2, err
    one_error(err, str(path), f"meta key '{key}'")


# --- 2. block tables: bounded positions, memory that follows them -------------------------------

PAGE = 1 << 16  # the largest page size the format admits

MEASURE_CLI = """
import json, sys
from refmla.cli import main
def kib(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key + ":")).split()[1])
open("/proc/self/clear_refs", "w").write("5")
base = kib("VmRSS")
code = main(sys.argv[1:])
print(json.dumps({"code": code, "peak": (kib("VmHWM") - base) * 1024}), file=sys.stderr)
"""


def write_table(path, pages: int, D: int = 64) -> Path:
    """One request whose block table names page 0 of a one-page pool ``pages`` times: pages * 65,536
    positions from a few KB of table (the amplification a token-slot capture cannot have)."""
    g = torch.Generator().manual_seed(0)
    t = {"q": torch.randn(1, 1, D, generator=g).bfloat16(), "kv_buffer": torch.randn(PAGE, 1, D, generator=g).bfloat16(),
         "block_table": torch.zeros(1, pages, dtype=torch.int32),
         "seq_lens": torch.tensor([pages * PAGE], dtype=torch.int32)}  # fmt: skip
    m = {"mode": "decode", "backend": "unknown", "kv_lora_rank": D, "qk_rope_head_dim": 0, "sm_scale": 0.125,
         "logit_cap": 0.0, "page_size": PAGE}  # fmt: skip
    raw_write(path, t, m)
    return Path(path)


def measured(*argv: str) -> tuple[int, int, str]:
    """(exit code, peak bytes above the imported CLI, stderr) of refmla's main in a fresh process."""
    r = subprocess.run([sys.executable, "-c", MEASURE_CLI, *argv], capture_output=True, text=True, cwd=ROOT,
                       env=MEASURE_ENV, timeout=600)  # fmt: skip
    lines = r.stderr.strip().splitlines()
    last = json.loads(lines[-1])
    return last["code"], last["peak"], "\n".join(lines[:-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs /proc to read the peak")
@pytest.mark.parametrize("cmd", ["replay", "inspect"])
def test_a_block_table_of_67m_positions_is_refused_up_front(tmp_path, cmd):
    path = write_table(tmp_path / "table.safetensors", 1024)  # 1024 x 65,536 = 67,108,864 positions
    code, peak, err = measured(cmd, str(path))
    assert code == 2
    one_error(err, str(path), "tensor 'block_table'", "67,108,864 positions", f"{MAX_POSITIONS:,}")
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB: the positions were expanded before the bound"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs /proc to read the peak")
def test_a_block_table_under_the_bound_is_inspected_in_memory_that_follows_it(tmp_path):
    """The contract's budget: 2 GiB for a table at the bound (MAX_POSITIONS), so 128 bytes a position."""
    pages = 32  # 2,097,152 positions
    path = write_table(tmp_path / "table.safetensors", pages)
    code, peak, err = measured("inspect", str(path))
    assert code in (0, 1), err  # the repeated page is a warning, not an error
    assert peak < 128 * pages * PAGE, f"peak {peak / 2**20:.0f} MiB for {pages * PAGE:,} positions"


def wide_sparse(path, sparse_good: Path, K: int, requests: int = 4) -> Path:
    """The clean capture's every query row reading one live token K times (this test's own
    indices): the keys a row gathers grow with K, and production's stored output (of the original
    rows) no longer fits, so the replay judges observed failing and searches it."""
    t, m = sparse_tensors(sparse_good)
    token = int(t["indices"][0, 0, 0])
    B = min(requests, t["q"].shape[0])
    t = {k: v[:B] if k in ("q", "out", "lse", "indices", "topk_length") else v for k, v in t.items()
         if not k.startswith("extra") and k not in ("seq_lens", "slot_indptr", "slots", "k_cache_pages")}  # fmt: skip
    t["indices"] = torch.full((B, t["q"].shape[1], K), token, dtype=torch.int32)
    t["topk_length"] = torch.full((B,), K, dtype=torch.int32)
    raw_write(path, t, m)
    return Path(path)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs /proc to read the peak")
@pytest.mark.parametrize("cmd", ["replay", "inspect"])
def test_a_sparse_top_k_past_the_bound_is_refused_up_front(tmp_path, sparse_good, cmd):
    """A 1e6-entry top-k over one token was the allocator's RuntimeError (4.6 GB for one row's keys)."""
    from refmla.sparse.validation import MAX_TOPK

    path = wide_sparse(tmp_path / "wide.safetensors", sparse_good, 1_000_000, requests=1)
    code, peak, err = measured(cmd, str(path))
    assert code == 2
    one_error(err, str(path), "tensor 'indices'", "1,000,000 entries", f"{MAX_TOPK:,}")
    assert peak < 256 << 20, f"peak {peak / 2**20:.0f} MiB: the keys were gathered before the bound"


def test_the_sparse_search_in_row_blocks_names_the_same_mistakes(tmp_path, monkeypatch):
    """The search's candidates and the neighbour-slot ranking work in blocks of query rows (and of
    entries), memory following a block: with one row (and one entry) a block, each planted mistake
    (refmla.sparse.faults' plain loop, never the search) is named with the same detail."""
    from refmla.options import ReplayOptions
    from refmla.pipeline import replay_file
    from refmla.sparse import hypotheses, misplaced, reference
    from refmla.sparse.make import synth_sparse

    paths = {f: tmp_path / f"{f}.safetensors" for f in ("scale_exponent_off_both", "other_rows_read", "sink_omitted")}
    for fault, path in paths.items():
        synth_sparse(path, "deepseek-v4-flash-tp8", fault)
    whole = {f: replay_file(str(p), ReplayOptions(backends=["reference", "observed"])) for f, p in paths.items()}
    monkeypatch.setattr(reference, "ROW_BLOCK_BYTES", 1)
    monkeypatch.setattr(misplaced, "ROW_BLOCK_BYTES", 1)
    monkeypatch.setattr(reference, "TABLE_BYTES", 0)  # no table of the whole call: block by block
    for fault, path in paths.items():
        got = replay_file(str(path), ReplayOptions(backends=["reference", "observed"])).backends["observed"].explanation
        want = whole[fault].backends["observed"].explanation
        assert want is not None and got is not None and got.hypothesis == want.hypothesis, (fault, got, want)
        assert got.detail == want.detail and got.request == want.request, (fault, got.detail, want.detail)


def test_a_sparse_call_past_the_search_budget_says_so(tmp_path, sparse_good, monkeypatch):
    """A call whose requests' rows are past the search's budget is not searched, and says so
    (info.search_skipped, as the dense search does); the finding stays a fail."""
    from refmla.sparse import hypotheses

    path = wide_sparse(tmp_path / "wide.safetensors", sparse_good, 4096)
    monkeypatch.setattr(hypotheses, "SEARCH_REQUEST_BYTES", 1 << 20)
    code, out, err = run_cli("replay", str(path), "--backend", "reference", "--json")
    obs = json.loads(out)["backends"]["observed"]
    assert code == 1 and obs["status"] == "fail" and obs.get("explanation") is None
    assert "4,096 entries" in obs["info"]["search_skipped"] and "not searched" in obs["info"]["search_skipped"]


# --- 3. one bad capture is its own report, serial and --jobs -----------------------------------


def mixed_folder(root: Path, sparse_good: Path) -> dict[str, str]:
    """dense/ + sparse/ like golden/: name -> what its report must say ("agree", or "present")."""
    (root / "sparse").mkdir(parents=True)
    write_small(root / "a_dense.safetensors")
    write_small(root / "z_dense.safetensors")
    t, m = sparse_tensors(sparse_good)
    raw_write(root / "sparse" / "good.safetensors", t, m)
    empty = dict(t, q=t["q"][:, :, :0].contiguous(), out=t["out"][:, :, :0].contiguous(),
                 lse=t["lse"][:, :, :0].contiguous(), attn_sink=t["attn_sink"][:0].contiguous())  # zero heads
    raw_write(root / "sparse" / "zero_heads.safetensors", empty, m)
    return {"a_dense": "agree", "z_dense": "agree", "good": "agree", "zero_heads": "present"}


def check_reports(doc: list, want: dict[str, str]) -> dict:
    got = {Path(r["capture"]).stem: r for r in doc}
    assert sorted(got) == sorted(want), sorted(got)
    for name, verdict in want.items():
        if verdict != "present":
            assert got[name]["verdict"] == verdict, (name, got[name].get("error"))
    return got


def test_a_capture_refmla_fails_on_costs_only_its_own_report(tmp_path, sparse_good, monkeypatch):
    """Serial: a MemoryError planted in the replay of one dense capture, a sparse capture with zero
    heads, among good dense and sparse ones: one array, every report, one line for the bad one."""
    import refmla.batch as batch

    want = mixed_folder(tmp_path, sparse_good)
    real = batch.replay_one

    def replay_one(path, opts):
        if Path(path).stem == "z_dense":
            raise MemoryError("planted by the test")
        return real(path, opts)

    monkeypatch.setattr(batch, "replay_one", replay_one)
    code, out, err = run_cli("replay", str(tmp_path), "--backend", "reference", "--json")
    got = check_reports(json.loads(out), dict(want, z_dense="invalid"))
    assert "MemoryError" in got["z_dense"]["error"] and code == 2
    lines = [ln for ln in error_lines(err) if ln.startswith("refmla: error:")]
    assert any("z_dense" in ln and "MemoryError" in ln for ln in lines), lines
    assert not any("(and" in ln for ln in lines), lines


def test_a_bad_capture_among_good_ones_under_jobs(tmp_path, sparse_good):
    want = mixed_folder(tmp_path, sparse_good)
    code, out, err = run_cli("replay", str(tmp_path), "--backend", "reference", "--json", "--jobs", "2")
    check_reports(json.loads(out), want)
    assert "Traceback" not in err and not any("(and" in ln for ln in error_lines(err))


# --- 4. one JSON document on stdout, every command ---------------------------------------------


def test_every_command_prints_one_json_document_over_a_mixed_folder(tmp_path, sparse_good):
    want = mixed_folder(tmp_path / "golden", sparse_good)
    folder = str(tmp_path / "golden")
    code, out, err = run_cli("replay", folder, "--backend", "reference", "--json")
    check_reports(json.loads(out), want)
    code, out, err = run_cli("inspect", folder, "--json")
    assert len(json.loads(out)) == len(want)
    dense, sparse = str(tmp_path / "golden" / "a_dense.safetensors"), str(tmp_path / "golden" / "sparse" / "good.safetensors")
    for argv in (["diff-kv", dense, sparse], ["diff-kv", sparse, dense], ["disagg", folder, "--decode", folder],
                 ["disagg", dense, sparse]):  # fmt: skip
        code, out, err = run_cli(*argv, "--json", "--backend", "reference") if argv[0] == "disagg" else run_cli(*argv, "--json")
        json.loads(out)  # the whole stdout: exactly one document
        assert code in (0, 1, 2) and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("argv", [["replay", "{empty}"], ["inspect", "{empty}"], ["disagg", "{empty}", "{empty}"],
                                  ["replay", "{empty}", "--k", "nan"], ["diff-kv", "{missing}", "{missing}"]])  # fmt: skip
def test_an_error_before_the_document_is_still_one_document(tmp_path, argv):
    (tmp_path / "empty").mkdir()
    argv = [a.format(empty=tmp_path / "empty", missing=tmp_path / "missing") for a in argv]
    code, out, err = run_cli(*argv, "--json")
    assert code == 2
    doc = json.loads(out)
    line = one_error(err)
    assert doc.get("ok") is False and doc["error"] in line


# --- 5. the second round's leftovers -----------------------------------------------------------


def computing_child(sid: int) -> bool:
    """A process of the session besides its leader, still there a second later (the kernel's child,
    not a short-lived helper process)."""
    first = set(session_members(sid)) - {sid}
    if not first:
        return False
    time.sleep(1.0)
    return bool(first & set(session_members(sid)))


# The kernel's child computes until it is stopped: refmla's CLI with the triton backend's run replaced by a
# busy loop (in the replay's process, so the forked child inherits it). A real interpreted kernel on this
# machine finishes in seconds, too soon to be caught running on a loaded one.
SPINNING_KERNEL = """
import sys
import refmla.backends.triton as triton
def spin(self, cap, opts):
    while True:
        pass
triton.TritonBackend.run = spin
from refmla.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the child processes")
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_a_serial_replay_leaves_no_isolation_child(tmp_path, sig, status):
    capture = write_small(tmp_path / "c.safetensors")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", REFMLA_ISOLATE="1")  # the suite turns it off
    argv = [sys.executable, "-c", SPINNING_KERNEL, "replay", "--backend", "triton", "--no-explain", str(capture)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=default_signals)  # not whatever the runner inherited
    try:
        assert wait_for(lambda: computing_child(proc.pid), 120), "no kernel child was forked"
        proc.send_signal(sig)  # to refmla alone, not to its child
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == status, err.decode()[-2000:]
        # reaped before refmla exits: nothing of the session is left once it has (the child would spin forever)
        assert wait_for(lambda: not session_members(proc.pid), 0.5), f"left running: {session_members(proc.pid)}"
        assert b"Traceback" not in err
    finally:  # whatever failed, nothing of the session outlives the test (a leftover child spins forever)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@pytest.mark.parametrize("before", [None, '{"format": "refmla.golden.manifest/1", "cases": [], "mine": 1}\n'])
def test_sigterm_during_golden_generate_leaves_the_manifest_as_it_was(tmp_path, before):
    out = tmp_path / "golden"
    out.mkdir()
    if before is not None:
        (out / "manifest.json").write_text(before)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    argv = [sys.executable, "-m", "refmla", "golden", "generate", "--suite", "full", "--out", str(out)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=default_signals)  # not whatever the runner inherited
    try:
        assert wait_for(lambda: any(out.glob("*.safetensors")), 120), "generate never started writing"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143
    manifest = out / "manifest.json"
    assert (manifest.read_text() if manifest.exists() else None) == before


@pytest.mark.parametrize("option,value", [("--layers", "0-1000000000000"), ("--layers", "0-1e12"), ("--ranks", "0-100000000000"),
                                          ("--ranks", "0-1e11"), ("--layers", "4096")])  # fmt: skip
def test_range_arguments_past_any_model_are_a_usage_error(tmp_path, option, value):
    code, out, err = run_cli("capture", "run", option, value, "--out", str(tmp_path / "c"), "--", "true")
    assert code == 2
    one_error(err, option)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_a_capture_whose_file_name_is_not_utf8_is_read(tmp_path, sparse_good):
    folder = os.fsencode(tmp_path)
    dense = os.fsdecode(folder + b"/dense\xff\xfe.safetensors")
    write_small(tmp_path / "tmp.safetensors")
    os.rename(tmp_path / "tmp.safetensors", dense)
    sparse = os.fsdecode(folder + b"/sparse\xe9.safetensors")
    os.link(sparse_good, sparse)
    code, out, err = run_cli("replay", dense, "--backend", "reference", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "agree", err
    code, out, err = run_cli("inspect", dense, sparse, "--json")
    assert code == 0, err
    code, out, err = run_cli("replay", str(tmp_path), "--backend", "reference", "--json")
    assert sorted(r["verdict"] for r in json.loads(out)) == ["agree", "agree"], err
    bad = os.fsdecode(folder + b"/bad\xff.safetensors")
    Path(bad).write_bytes(b"not a capture")
    code, out, err = run_cli("replay", bad)
    line = one_error(err, "bad")
    assert code == 2 and "\udcff" not in line and "\\udcff" in line  # printed escaped, never as raw bytes
