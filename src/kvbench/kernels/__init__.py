"""Triton kernels (the GPU path), each beside its torch reference. Imported as ``kvbench.kernels``.

Which path runs is the config's ``kernels``: ``auto`` (on CUDA, Triton per kernel and call where
the measured dispatch table says it is faster, ``dispatch_table.json``; torch elsewhere), ``torch``
or ``triton`` (on a CPU: under ``TRITON_INTERPRET=1``, slowly; for tests). A cell resolves it once
(:func:`dispatch.resolve`) and runs inside :func:`dispatch.using`; the cache's operations take a
kernel module from :func:`dispatch.kernels` (None on the torch path), so the techniques do not
change. Today: KIVI's quantize-and-pack and unpack-and-dequantize
(:mod:`kvbench.kernels.kivi`), decode attention over ragged heads, by positions, lengths or a
mask (:mod:`kvbench.kernels.attention`), block scoring for the read selectors
(:mod:`kvbench.kernels.scoring`), fused decode attention over KIVI's codes
(:mod:`kvbench.kernels.kivi_decode`) and over low-rank latents (:mod:`kvbench.kernels.latent_decode`),
and compaction after an eviction
(:mod:`kvbench.kernels.compaction`); docs/kernels.md.
"""
