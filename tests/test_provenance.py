"""diff-kv names where a misplaced page's bytes are (issue 21 part 5): another request's page, and
the same request's pages one page ahead, by hashing the prefill rows."""

from __future__ import annotations

from test_diffkv import by_request, pair

from refmla.diffkv import diff_kv_files
from refmla.render.diffkv import render_diff
from refmla.diffkv.provenance import Source


def test_a_page_holding_another_requests_page_is_named(tmp_path):
    def foreign(pool, slots):  # decode batch order (2, 0, 1): slots[0] is req-2, slots[1] req-0
        pool[slots[0][32:48]] = pool[slots[1][16:32]].clone()  # req-2's page 2 <- req-0's page 1

    p, d, _ = pair(tmp_path, decode_mutate=foreign)
    result = diff_kv_files(p, d)
    e = by_request(result)["req-2"]
    (src,) = e.sources
    assert (src.start, src.end, src.rid, src.source_start, src.same_request) == (32, 48, "req-0", 16, False)
    assert src.text("req-2") == "decode page 2 of req-2 holds prefill req-0's page 1"
    assert "decode page 2 of req-2 holds prefill req-0's page 1" in render_diff(result)
    assert e.to_json()["sources"][0]["source_rid"] == "req-0"


def test_pages_one_page_ahead_are_named(tmp_path):
    def ahead(pool, slots):
        rows = slots[0]  # req-2: pages 3-5 hold its pages 4-6
        pool[rows[48:96]] = pool[rows[64:112]].clone()

    p, d, _ = pair(tmp_path, decode_mutate=ahead)
    (src,) = by_request(diff_kv_files(p, d))["req-2"].sources
    assert (src.start, src.end, src.shift, src.same_request) == (48, 96, 16, True)
    assert src.text() == "pages 3-5 hold pages 4-6 (one page ahead)"


def test_rows_that_did_not_land_have_no_source(tmp_path):
    def zero(pool, slots):
        pool[slots[0][16:32]] = 0

    p, d, _ = pair(tmp_path, decode_mutate=zero)
    e = by_request(diff_kv_files(p, d))["req-2"]
    assert e.mismatched_positions == 16 and e.sources == []  # a zero row matches every zero row


def test_a_shift_that_is_not_whole_pages_is_said_in_positions():
    src = Source(0, 3, "r", 5, same_request=True, page_size=1)
    assert src.text() == "positions 0-2 hold positions 5-7 (5 positions ahead)"


def test_a_prefill_page_written_at_its_place_and_the_next_is_named_twice(tmp_path):
    def twice(pool, slots):
        rows = slots[0]  # req-2: its page 2 also written over its page 3
        pool[rows[48:64]] = pool[rows[32:48]].clone()

    p, d, _ = pair(tmp_path, decode_mutate=twice)
    e = by_request(diff_kv_files(p, d))["req-2"]
    (src,) = e.sources
    assert (src.start, src.end, src.source_start, src.also_at) == (48, 64, 32, 32)
    assert src.text() == "page 3 holds page 2 (one page behind); prefill page 2 written twice (also at decode page 2)"
    assert e.to_json()["sources"][0]["also_at"] == 32


def test_one_prefill_page_found_at_two_decode_pages_is_named_twice(tmp_path):
    def foreign_twice(pool, slots):  # req-0's page 1 over req-2's pages 2 and 5
        pool[slots[0][32:48]] = pool[slots[1][16:32]].clone()
        pool[slots[0][80:96]] = pool[slots[1][16:32]].clone()

    p, d, _ = pair(tmp_path, decode_mutate=foreign_twice)
    a, b = by_request(diff_kv_files(p, d))["req-2"].sources
    assert (a.start, a.also_at, b.start, b.also_at) == (32, 80, 80, 32)
    assert a.text("req-2") == ("decode page 2 of req-2 holds prefill req-0's page 1; prefill page 1 written twice "
                               "(also at decode page 5)")


def test_a_shift_is_not_called_written_twice(tmp_path):
    def ahead(pool, slots):  # pages 3-5 hold pages 4-6: page 6's rows are at pages 5 and 6, but a shift says it
        pool[slots[0][48:96]] = pool[slots[0][64:112]].clone()

    p, d, _ = pair(tmp_path, decode_mutate=ahead)
    (src,) = by_request(diff_kv_files(p, d))["req-2"].sources
    assert src.also_at is None and "twice" not in src.text()
