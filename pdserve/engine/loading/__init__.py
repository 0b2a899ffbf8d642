"""Model loading: config.json, checkpoints, the serving dtype, the weights fingerprint."""
