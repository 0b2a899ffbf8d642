"""The bottom of the house: wire protocol, KV layout, sampling params, addressing, env, logging.

Imports nothing else of the project (a test enforces it).
"""
