"""Schedulers: which tokens stay in the cache as the sequence grows."""
