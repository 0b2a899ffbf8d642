"""What the transfer layer does to a KV pool in place: host, shared-memory, staged and CUDA IPC pools."""
