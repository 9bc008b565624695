"""`refmla diff-kv` and `refmla disagg` over sparse pools (issue 28): DeepSeek-V4 pairs (a window cache and
a C4 / C128 compressed cache per layer) and a V3.2 pair written by `refmla synth-disagg` with transfer
faults its own code plants in either cache; each is named with its cache, page, position and run, a
clean pair is clean, packed bytes are compared exactly (one rope byte, one UE8M0 byte), mixed dense and
sparse folders give one JSON document, bad sparse input is exit 2 with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hostile import error_lines, run_cli
from refmla.context import ReplayOptions
from refmla.disagg import run_disagg
from refmla.sparse.format import KV_MAP
from refmla.sparse.validation import read_sparse
from refmla.synthetic.disagg import disagg_preset, synth_disagg
from refmla.synthetic.disagg_sparse import SPARSE_DISAGG_FAULTS, SPARSE_DISAGG_PRESETS

FAST = ReplayOptions(backends=["extend"])  # reference, observed (no sparse kernel): the transfer is the question
V4_FAULTS = [f for f in SPARSE_DISAGG_FAULTS if f != "none"]
PROMPTS = SPARSE_DISAGG_PRESETS["disagg-v4"].prompts


def files(root: Path, side: str) -> list[str]:
    return sorted(str(p) for p in (root / side).glob("*.safetensors"))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(preset, fault) -> (folder, what was planted), written once by the command line."""
    root = tmp_path_factory.mktemp("sparse-disagg")
    out = {}
    for preset, fault in [*(("disagg-v4", f) for f in SPARSE_DISAGG_FAULTS), ("disagg-v32", "window_page_shifted")]:
        folder = root / preset / fault
        code, text, err = run_cli("synth-disagg", str(folder), "--preset", preset, "--fault", fault)
        assert code == 0, err
        out[preset, fault] = (folder, json.loads(text.split("planted ", 1)[1].rstrip(")\n")))
    return out


def disagg_json(folder: Path) -> tuple[int, dict, str]:
    code, out, err = run_cli("disagg", str(folder / "prefill"), str(folder / "decode"), "--json", "--backend", "reference")
    return code, json.loads(out), err  # json.loads: exactly one document


def test_disagg_names_a_compressed_cache_page_that_never_landed(pairs):
    """The issue's done-when: a V4 pair from synth-disagg, its compressed cache's page 1 of one request
    zeroed by the synth; disagg exits 1, class transfer, the cache, page, position and run named."""
    folder, planted = pairs["disagg-v4", "compressed_page_missing"]
    code, doc, _ = disagg_json(folder)
    assert code == 1 and doc["fault"] == "transfer" and doc["classes"]["transfer"] == 1
    (row,) = [r for r in doc["rows"] if r["fault"] != "none"]
    e = planted["expect"]
    assert (row["rid"], row["layer"], row["rank"]) == (e["rid"], e["layer"], e["rank"]) == ("disagg-v4-r2", 2, 0)
    t = row["transfer"]
    assert t["status"] == "mismatch" and t["cache"] == "compressed" and t["cache_label"] == "compressed cache (C4)"
    assert (t["first_mismatch"], t["first_page"], t["mismatched_pages"]) == (64, 1, [1])
    assert t["run"]["start"] == 64 and t["run"]["end"] == 128 and t["run"]["decode_zero_rows"] == 64
    assert t["caches"]["window"]["status"] == "match" and t["caches"]["compressed"]["mismatched_positions"] == 64
    assert "compressed cache (C4) page 1 of disagg-v4-r2" in row["sentence"] and "not landed" in row["sentence"]
    assert "compressed cache (C4) page 1 of disagg-v4-r2" in doc["sentence"]
    assert row["decode"]["verdict"] == "agree"  # the decode kernel read what arrived: the transfer is the fault


def test_a_clean_v4_pair_is_clean(pairs):
    folder, _ = pairs["disagg-v4", "none"]
    code, doc, err = disagg_json(folder)
    assert code == 0, err
    assert doc["fault"] == "none" and len(doc["rows"]) == 8 and not doc["invalid"]
    for row in doc["rows"]:
        t = row["transfer"]
        assert row["fault"] == "none" and t["status"] == "faithful"
        caches, prompt = t["caches"], PROMPTS[int(row["rid"][-1])]
        entries = prompt // {2: 4, 3: 128}[row["layer"]]  # C4 / C128 entries (a 45-token prompt has no C128 one)
        assert caches["window"]["status"] == "match"
        assert caches["compressed"]["status"] == ("match" if entries else "nothing_compared")
        assert caches["compressed"]["positions_compared"] == entries
        assert t["positions_compared"] == sum(c["positions_compared"] for c in caches.values()) > 0


@pytest.mark.parametrize("fault", V4_FAULTS)
def test_each_planted_sparse_fault_is_named_with_its_cache(pairs, fault):
    folder, planted = pairs["disagg-v4", fault]
    e = planted["expect"]
    report = run_disagg(files(folder, "prefill"), files(folder, "decode"), FAST)
    assert report.exit_code == 1 and report.fault == "transfer"
    for r in report.rows:
        hit = (r.rid, r.layer, r.rank) == (e["rid"], e["layer"], e["rank"])
        assert r.fault == ("transfer" if hit else "none"), r.sentence
        if not hit:
            continue
        t = r.transfer
        assert t.cache == e["cache"] and (t.first_mismatch, t.first_page) == (e["position"], e["page"])
        assert f"{t.cache_label} page {e['page']} of {e['rid']}" in r.sentence
        assert t.run is not None and t.run["start"] <= e["position"] < t.run["end"]
        assert t.run.get("offset") == e.get("offset")
        if e.get("sections"):  # one byte changed: one position, that section only
            assert t.mismatched_positions == 1 and {k for k, n in t.sections.items() if n} == {e["sections"]}
            assert "bytes differ" in r.sentence
        if e.get("zero_rows"):
            assert t.decode_zero_rows == t.mismatched_positions == 64


def diff_json(prefill: str, decode: str) -> tuple[int, dict, str]:
    code, out, err = run_cli("diff-kv", prefill, decode, "--json")
    return code, json.loads(out), err


def test_diff_kv_of_a_clean_sparse_pair_compares_both_caches(pairs):
    folder, _ = pairs["disagg-v4", "none"]
    code, doc, err = diff_json(files(folder, "prefill")[0], files(folder, "decode")[0])
    assert code == 0 and doc["ok"], err
    assert [e["cache"] for e in doc["requests"]] == ["window", "compressed"] * 4
    assert all(e["status"] == "match" for e in doc["requests"])
    assert doc["caches"]["window"]["page_size"] == 256 and doc["caches"]["compressed"]["page_size"] == 64
    assert doc["positions_compared"] == sum(c["positions_compared"] for c in doc["caches"].values())
    # the window cache holds positions from the window's first page on: request 2 (1100 tokens) from 768
    r2 = [e for e in doc["requests"] if e["request"] == "disagg-v4-r2"]
    assert r2[0]["positions_compared"] == 1100 - 768 and r2[1]["positions_compared"] == 1100 // 4


@pytest.mark.parametrize("fault, cache, section", [("window_rope_byte", "window", "rope"),
                                                   ("compressed_scale_byte", "compressed", "scales"),
                                                   ("compressed_page_missing", "compressed", None),
                                                   ("window_page_shifted", "window", None)])  # fmt: skip
def test_diff_kv_finds_a_fault_in_each_cache_byte_exact(pairs, fault, cache, section):
    folder, planted = pairs["disagg-v4", fault]
    e = planted["expect"]
    code, doc, _ = diff_json(files(folder, "prefill")[0], files(folder, "decode")[0])  # layer 2: the fault's
    assert code == 1 and not doc["ok"]
    bad = [x for x in doc["requests"] if x["status"] == "mismatch"]
    assert [(x["request"], x["cache"]) for x in bad] == [(e["rid"], cache)]
    (x,) = bad
    assert x["first_mismatch"] == e["position"] and x["mismatched_pages"][0] == e["page"]
    runs = x["transfer_runs"]
    assert runs["with_mismatches"] == 1 and runs["mismatched"][0]["pages"] == [e["page"], e["page"]]
    if section is not None:
        assert x["mismatched_positions"] == 1
        assert x["differing_sections"] == {**{"nope": 0, "rope": 0, "scales": 0}, section: 1}
    elif e.get("offset"):
        assert runs["mismatched"][0]["offset"] == 1 and x["mismatched_positions"] == 256
    else:
        assert runs["mismatched"][0]["decode_zero_rows"] == 64 and x["decode_zero_rows"] == 64


def test_a_v32_pair_names_its_one_cache(pairs):
    folder, planted = pairs["disagg-v32", "window_page_shifted"]
    e = planted["expect"]
    assert e["cache"] == "main"
    report = run_disagg(files(folder, "prefill"), files(folder, "decode"), FAST)
    (row,) = [r for r in report.rows if r.fault != "none"]
    assert row.fault == "transfer" and row.transfer.cache == "main" and row.transfer.run["offset"] == 1
    assert "main cache page 0 of disagg-v32-r2" in row.sentence


def test_mixed_dense_and_sparse_folders_give_one_json_document(pairs, tmp_path):
    sparse, _ = pairs["disagg-v4", "none"]
    synth_disagg(tmp_path / "dense", disagg_preset("disagg-small"), "none")  # layers 0, 1; the V4 pair: 2, 3
    for side in ("prefill", "decode"):
        (tmp_path / "mixed" / side).mkdir(parents=True)
        for p in [*files(tmp_path / "dense", side), *files(sparse, side)]:
            shutil.copy(p, tmp_path / "mixed" / side / f"{Path(p).parent.parent.name}-{Path(p).name}")
    code, doc, err = diff_json(str(tmp_path / "mixed" / "prefill"), str(tmp_path / "mixed" / "decode"))
    assert code == 0, err
    assert isinstance(doc, list) and len(doc) == 8 and all(r["ok"] for r in doc)
    assert sum("caches" in r for r in doc) == 4  # the sparse decode captures' results carry their caches
    code, doc, err = disagg_json(tmp_path / "mixed")
    assert code == 0 and doc["fault"] == "none", err
    assert {r["layer"] for r in doc["rows"]} == {0, 1, 2, 3}


def test_a_dense_capture_against_a_sparse_one_is_one_line(pairs, tmp_path):
    sparse, _ = pairs["disagg-v4", "none"]
    synth_disagg(tmp_path / "dense", disagg_preset("disagg-small"), "none")
    dense = files(tmp_path / "dense", "prefill")[0]
    code, out, err = run_cli("diff-kv", dense, files(sparse, "decode")[0])
    (line,) = error_lines(err)
    assert code == 2 and dense in line and "meta key 'mode'" in line and "Traceback" not in err


def _rewrite(src: str, dst: Path, drop=(), change=None, meta=None) -> str:
    """A copy of a sparse capture with tensors dropped or changed (no validation: bad input)."""
    from helpers import raw_write
    from safetensors import safe_open

    with safe_open(src, "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        header = f.metadata()
    t.update(change or {})
    m = json.loads(header["meta"])
    m.update(meta or {})
    raw_write(dst, t, m)
    return str(dst)


@pytest.mark.parametrize("case, named", [
    ("no_kv_map", "tensor 'seq_lens'"),
    ("no_extra_slots", "tensor 'extra_slots'"),
    ("no_slot_indptr", "tensor 'slot_indptr'"),
    ("pages_short", "tensor 'k_cache_pages'"),
    ("other_layout", "meta key 'kv_layout'"),
])  # fmt: skip
def test_bad_sparse_input_is_one_line_naming_the_file_and_tensor(pairs, tmp_path, case, named):
    folder, _ = pairs["disagg-v4", "none"]
    prefill, decode = files(folder, "prefill")[0], files(folder, "decode")[0]
    bad = tmp_path / "bad.safetensors"
    if case == "no_kv_map":
        decode = _rewrite(decode, bad, drop=("seq_lens", *KV_MAP[""], *KV_MAP["extra_"]))
    elif case == "no_extra_slots":
        decode = _rewrite(decode, bad, drop=KV_MAP["extra_"])
    elif case == "no_slot_indptr":
        decode = _rewrite(decode, bad, drop=("slot_indptr",))
    elif case == "pages_short":
        decode = _rewrite(decode, bad, change={"k_cache_pages": read_sparse(decode).k_cache_pages[:-1].clone()})
    else:  # the V3.2 pair's prefill capture against a V4 decode capture
        v32, _ = pairs["disagg-v32", "window_page_shifted"]
        prefill = files(v32, "prefill")[0]
    for argv in ((prefill, decode), (prefill, decode, "--json")):
        code, out, err = run_cli("diff-kv", *argv)
        (line,) = error_lines(err)
        assert code == 2 and named in line and "Traceback" not in err, err
        assert decode in line
        if "--json" in argv:
            doc = json.loads(out)
            assert doc["ok"] is False and named in doc["error"]


def test_the_kv_map_is_validated_on_write(pairs, tmp_path):
    """A slot past its cache, a request whose list is not seq_lens long: refused by name."""
    from refmla.capture import CaptureError
    from refmla.sparse.validation import problems

    folder, _ = pairs["disagg-v4", "none"]
    cap = read_sparse(files(folder, "decode")[0])
    cap.slots = cap.slots.clone()
    cap.slots[3] = cap.k_cache.shape[0] * cap.meta.page_size  # one past the cache
    assert any("tensor 'slots'" in str(e) and "outside the cache" in str(e) for e in problems(cap))
    cap = read_sparse(files(folder, "decode")[0])
    cap.seq_lens = cap.seq_lens.clone() + 1
    found = [str(e) for e in problems(cap)]
    assert found and "tensor 'slot_indptr'" in found[0] and "seq_lens says" in found[0]
    assert isinstance(problems(cap)[0], CaptureError)


def test_disagg_plot_with_a_diverging_sparse_decode_capture_says_it_is_not_drawn(tmp_path):
    """--plot draws dense replays; a sparse decode capture whose replay diverges is refused in one
    stderr line (issue 33 class 6: it was skipped in silence), the disagg report unchanged."""
    pytest.importorskip("matplotlib")
    from safetensors import safe_open

    from helpers import raw_write

    folder = tmp_path / "pair"
    assert run_cli("synth-disagg", str(folder), "--preset", "disagg-v4", "--fault", "none")[0] == 0
    path = sorted((folder / "decode").glob("*.safetensors"))[0]
    with safe_open(str(path), "pt") as f:
        t, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()["meta"]
    t["out"] = (t["out"].double() * 2 + 1).to(t["out"].dtype)  # production's output off, by this test's code
    raw_write(path, t, json.loads(meta))
    code, out, err = run_cli("disagg", str(folder / "prefill"), str(folder / "decode"), "--backend", "reference",
                             "--plot", str(tmp_path / "plots"))  # fmt: skip
    said = [ln for ln in error_lines(err) if "--plot" in ln]
    assert code == 1 and len(said) == 1 and str(path) in said[0] and "not drawn" in said[0], err
    assert not list((tmp_path / "plots").glob(f"{path.stem}*"))
