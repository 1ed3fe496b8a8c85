"""Completion-only supervised fine-tuning: `trainer` (`CompletionSFTTrainer`, the kit's one SFT loop, on
transformers' `Trainer`) and `student` (a fresh student distilled on a teacher's traces: its settings, LoRA,
saving, its held-out NLL)."""
