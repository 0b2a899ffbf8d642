"""The model runner: weights and the KV pool on a device, CUDA graphs, step staging, memory budget."""
