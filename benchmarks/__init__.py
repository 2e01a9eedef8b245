"""Benchmarks: medians and ratios against a baseline measured in the same run.

Run one with ``python -m benchmarks.<name>``, or all with ``python -m benchmarks``.
"""
