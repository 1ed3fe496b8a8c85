"""On-policy distillation: `loss` (generalized JSD, chunked over the vocabulary), `arguments` (its settings,
declared once), `trainer` (`DistillTrainer` on transformers' `Trainer`), `callbacks`; `teachers` (the teacher
kinds behind one interface: in process, served, top-K, another tokenizer, several); a teacher served
elsewhere: `served` (its final hidden states from a vLLM pooling server, `ServedTeacher`), `head` (its output
head read alone from the checkpoint), `topk` (the approximate divergence from top-K log-probabilities),
`mixture` (several teachers: routed rows, weighted divergences, teacher-set fingerprints)."""
