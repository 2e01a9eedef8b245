"""The install boundary: what the connector and the cache server import, and nothing else.

Protocol, keys, rank and fan-out rules, RPC, block copies, KV layout, credentials, owned
files, process groups, bounds, sizes, telemetry and the eviction policies. Imports nothing
from the rest of ``testbed`` (ARCHITECTURE.md; ``tests/test_layers.py`` keeps it so).
"""
