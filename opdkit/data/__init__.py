"""What the models read and how answers are judged: `prompts` (load, normalise, filter, collate), `tasks` (one
kind of problem each: prompts, held-out rows, checking), `answers` (final answers and math-verify), `traces`
(a teacher's conversations with labels), `sft` (completion-only fine-tuning), `prepare` (the data files of the
full presets)."""
