"""On-policy distillation: `loss` (generalized JSD, chunked over the vocabulary), `arguments` (its settings,
declared once), `trainer` (`DistillTrainer` on transformers' `Trainer`), `callbacks`; a teacher served
elsewhere: `served` (its final hidden states from a vLLM pooling server, `ServedTeacher`), `head` (its output
head read alone from the checkpoint), `topk` (the approximate divergence from top-K log-probabilities),
`mixture` (several teachers: routed rows, weighted divergences, teacher-set fingerprints)."""
