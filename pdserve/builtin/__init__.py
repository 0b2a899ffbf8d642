"""The built-in models: tokenizer, training corpus, trainer, random and trained checkpoints."""
