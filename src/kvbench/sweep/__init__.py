"""Sweeps of many cells: the technique matrix, planning and resume, fault isolation, progress."""
