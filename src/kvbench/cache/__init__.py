"""kvbench's KV cache engine: ragged per-head storage, exact byte accounting, the attention hook."""
