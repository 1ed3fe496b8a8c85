"""On-policy distillation: `loss` (generalized JSD, chunked over the vocabulary), `arguments` (its settings,
declared once), `trainer` (`DistillTrainer` on transformers' `Trainer`), `callbacks`."""
