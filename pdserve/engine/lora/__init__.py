"""LoRA adapters on the base model: PEFT checkpoints (`checkpoint`), the resident/host
registry (`registry`) and the per-step segmented update (`batch`)."""
