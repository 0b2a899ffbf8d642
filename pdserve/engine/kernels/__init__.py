"""Native CPU kernels (C, loaded with ctypes) and their Python wrappers."""
