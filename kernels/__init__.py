"""Triton kernels (GPU path), each beside its torch reference. Imported as ``kvbench.kernels``.

Empty for now: the torch reference path in ``kvbench.cache`` is the execution path on every device.
"""
