"""Pure models, importable by engines and analysis alike: KV profiles, the time model and its
calibration, the oracle (prefix-cache simulation over chunk keys), servable-request sizing.
Imports ``testbed.core`` only (ARCHITECTURE.md).
"""
