"""Builds the optional native copy kernel; all other metadata is in pyproject.toml.

`kv_transfer/_hostcopy.c` uses no Python API (kv_transfer/hostcopy.py loads it
with ctypes). It is optional: without a C compiler the install succeeds and
the transfer layer uses numpy instead (slower shared-memory transfers).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kv_transfer._hostcopy",
            sources=["kv_transfer/_hostcopy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
