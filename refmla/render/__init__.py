"""Text for people: every typed result rendered as a table or lines (the JSON is each result's to_json).

    table.py     the plain column table and number formatting
    replay.py    one replay report, and the summary of many by layer, rank and step
    inspect.py   one `refmla inspect` entry
    diffkv.py    a diff-kv result (refmla.diffkv)
    disagg.py    a disagg report (refmla.disagg)
    regions.py   a region check's buffers and verdict (refmla regions)
    sweep.py     a sweep report (refmla.sweep)
"""
