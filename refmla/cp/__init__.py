"""Decode context parallelism (DCP): the ranks' captures of one step replayed as one call
(docs/context-parallel.md). Each rank holds an interleaved shard of every request's KV
(refmla.capture.dcp), attends it, and the ranks' partial outputs are combined by their lse.

Modules, imports going down this list:

    result.py      typed results: CpFinding, RankEntry, CombineEntry, CpReport (to_json, exit code)
    step.py        a folder of one step's rank captures: read, metadata agreed across ranks, each
                   rank's shard rows, the whole (unsharded) context
    hypotheses.py  which context-parallel mistake reproduces a rank's output or the combine's
    judge.py       the fp64 reference over the whole context; each rank on its shard; the combine
                   as a merge -> CpReport
    replay.py      a step inside `refmla replay`: the given captures grouped into steps, a step's
                   judgment as the one ReplayReport (kind context_parallel)
"""
