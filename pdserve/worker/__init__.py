"""What every worker role shares: process main, runtime loop, heartbeats, metrics
snapshot, engine glue, fault hooks, gateway links and the colocated node.

Imports `engine`, `kv_transfer` and `common`; never a node package (a test enforces it).
"""
