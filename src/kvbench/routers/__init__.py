"""Routers: which shard of the stored cache each query reads."""
