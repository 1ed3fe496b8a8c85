"""On-policy distillation: `loss` (generalized JSD, chunked over the vocabulary), `arguments` (its settings,
declared once), `trainer` (`DistillTrainer` on transformers' `Trainer`), `callbacks`; `teachers` (the teacher
kinds behind one interface, each in its own home: `local` in process, `served` by a vLLM pooling server,
`topk` from top-K log-probabilities, `cross` with another tokenizer, `sets` of several teachers)."""
