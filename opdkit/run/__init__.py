"""Running a job: `folders` (one run directory per run), `files` (atomic writes, JSON lines), `checkpoints`
(the newest complete checkpoint to resume from), `launch` (1 or N processes), `sharding` (DDP or FSDP2),
`tracking` (experiment trackers), `cli` (`python -m opdkit.<job>`), `server` (a server the run starts and
stops: a vLLM teacher server)."""
