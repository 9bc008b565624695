"""DeepSeek's lightning indexer (V3.2 DSA; V4's C4 layers): the top-k the sparse decode attends,
captured (meta ``mode`` ``indexer``), judged against an fp64 reference, its mistakes named.

Modules, imports going down this list:

    format.py      the capture: tensors, meta (topk, compress_ratio, indices_kind, k_layout), IndexerCapture
    io.py          read / write (refmla.capture.kinds: lazy, validated, atomic)
    reference.py   the indexer's logits in fp64 and at a kernel's rounding points (the noise), the one
                   judge of a produced index set (entries missing / not belonging, scores, ranks)
    hypotheses.py  which indexer mistake explains a wrong set (stale, unwritten, future, off by, scale,
                   relu, weights, compress ratio, length)
    adapters.py    the GPU indexer kernels (DeepGEMM paged / ragged, SGLang's tilelang, aiter) by their real
                   signatures, their logits topped per row
    backends.py    the engines' indexer code that runs here, by name (SGLang's and vLLM's torch paths, the adapters)
    judge.py       production's indices and each engine's code judged -> ReplayReport
    chain.py       a sparse decode capture's indices judged by the indexer capture beside it
    synth.py       synthetic indexer captures with planted faults, by their own plain loop
"""
