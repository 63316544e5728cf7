"""kvbench's KV cache engine: per-head-row storage with exact byte accounting, and every hook into
transformers (the cache and attention function in :mod:`.engine`, the rotary embedding in
:mod:`.rotary`, the calibration attention in :mod:`.capture`)."""
