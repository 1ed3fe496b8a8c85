"""Every combination of teacher kind, rollout source, rollout engine and processes the whitebox job can be
given, and what the job's checks say of each: built (and which test runs it), or refused, with the one line
a user gets (`inputs.check_combination`, run before the run folder is written). docs/combinations.md holds the
table this renders; a test checks it there verbatim and that every test it names exists.

    python -m opdkit.jobs.whitebox.combinations docs/combinations.md   # rewrites the table in that file
    python -m opdkit.jobs.whitebox.combinations                     # prints it

The checks read the settings alone (a dry run: no tokenizer, server, GPU or vllm package is needed here), so
a cell says what any machine would: a machine without vllm or GPUs refuses more, in its own line.
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass
from pathlib import Path

from opdkit.config import ConfigError, load_config
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.jobs.whitebox.inputs import check_combination

SERVER = "http://teacher:8000"  # any URL: the checks read the settings, they call no server
BPE = "tiny:teacher-bpe"  # a teacher with another tokenizer
# teacher kind -> (its settings, whether its tokenizer is another one)
KINDS: dict[str, tuple[dict, bool]] = {
    "in process": ({}, False),
    "served, exact": ({"teacher_server": SERVER}, False),
    "served, top-K": ({"teacher_server": SERVER, "teacher_logprobs": "topk:20"}, False),
    "another tokenizer": ({"teacher_model": BPE}, True),
    "another tokenizer, served": ({"teacher_model": BPE, "teacher_server": SERVER}, True),
    "another tokenizer, served top-K": (
        {"teacher_model": BPE, "teacher_server": SERVER, "teacher_logprobs": "topk:20"},
        True,
    ),
    "a set (weighted)": ({"teachers": "a=tiny:teacher,b=tiny:teacher", "teacher_weights": "a=1,b=1"}, False),
    # topk:5 stands for every defence: the checks read the kind alone, but for sampled's beta 1
    "defended (top-K 5)": ({"teacher_defence": "topk:5"}, False),
}
EPISODES = {"environment": "calculator"}
AHEAD = {"rollout_ahead": 1}
CORRECTED = {"rollout_ahead": 1, "async_correction": "truncated"}
SOURCES: dict[str, dict] = {
    "single-turn": {},
    "single-turn, ahead": AHEAD,
    "single-turn, ahead, corrected": CORRECTED,
    "episodes": EPISODES,
    "episodes, ahead": {**EPISODES, **AHEAD},
    "episodes, ahead, corrected": {**EPISODES, **CORRECTED},
}
ENGINES: dict[str, dict] = {"hf": {}, "vllm": {"rollout_engine": "vllm"}}
PROCESSES: dict[str, dict] = {
    "1": {},
    "2 ddp": {"num_processes": 2},
    "2 fsdp": {"num_processes": 2, "parallelism": "fsdp"},
}

# (kind, source, engine, processes) -> the test that runs that combination (tests/<file>, its function).
TESTED: dict[tuple[str, str, str, str], tuple[str, str]] = {
    ("in process", "single-turn", "hf", "1"): (
        "test_jobs_whitebox.py",
        "test_step_gradient_equals_direct_trl_computation",
    ),
    ("in process", "single-turn", "hf", "2 ddp"): (
        "test_jobs_whitebox.py",
        "test_two_gloo_processes_give_the_same_first_update",
    ),
    ("in process", "single-turn", "hf", "2 fsdp"): (
        "test_run_sharding.py",
        "test_fsdp_first_update_equals_one_process_and_trl",
    ),
    ("in process", "single-turn", "vllm", "1"): (
        "test_rollout_engines_vllm.py",
        "test_the_gradient_given_the_sampled_tokens_does_not_depend_on_the_engine",
    ),
    ("in process", "single-turn", "vllm", "2 ddp"): (
        "test_rollout_engines_vllm.py",
        "test_one_and_two_gloo_processes_with_engines_sample_the_same_and_make_the_same_first_update",
    ),
    ("in process", "single-turn, ahead", "hf", "1"): (
        "test_rollout_ahead.py",
        "test_a_resumed_asynchronous_run_regenerates_its_queued_steps_and_equals_the_unbroken_run",
    ),
    ("in process", "single-turn, ahead", "hf", "2 ddp"): (
        "test_rollout_ahead.py",
        "test_two_gloo_processes_each_with_its_producer_take_the_one_process_runs_steps",
    ),
    ("in process", "single-turn, ahead", "vllm", "1"): (
        "test_rollout_ahead_vllm.py",
        "test_the_vllm_producer_samples_and_updates_as_the_kit_loop_producer",
    ),
    ("in process", "single-turn, ahead, corrected", "hf", "1"): (
        "test_rollout_ahead.py",
        "test_the_corrected_gradient_is_the_capped_ratios_times_each_tokens_divergence_gradient",
    ),
    ("in process", "episodes", "hf", "1"): (
        "test_rollout_multiturn.py",
        "test_tool_tokens_carry_no_loss_and_no_gradient_and_the_loss_is_the_direct_reverse_kl",
    ),
    ("in process", "episodes", "hf", "2 ddp"): (
        "test_rollout_multiturn_processes.py",
        "test_one_and_two_gloo_processes_play_the_same_episodes_and_take_the_same_first_update",
    ),
    ("in process", "episodes", "vllm", "1"): (
        "test_rollout_multiturn_vllm.py",
        "test_vllm_plays_the_kit_loops_episodes_through_tool_turns_with_the_trainers_logprobs",
    ),
    ("in process", "episodes, ahead", "hf", "1"): (
        "test_rollout_ahead_episodes.py",
        "test_episodes_sampled_ahead_killed_and_resumed_end_with_the_unbroken_runs_losses",
    ),
    ("in process", "episodes, ahead, corrected", "hf", "1"): (
        "test_rollout_ahead_episodes.py",
        "test_episodes_sampled_ahead_by_unchanged_weights_are_the_synchronous_episodes",
    ),
    ("served, exact", "single-turn", "hf", "1"): (
        "test_jobs_whitebox_served.py",
        "test_a_served_teacher_takes_the_in_process_teachers_first_update",
    ),
    ("served, exact", "episodes", "hf", "1"): (
        "test_jobs_whitebox_served.py",
        "test_a_served_teacher_takes_the_in_process_first_update_through_tool_turns",
    ),
    ("served, top-K", "single-turn", "hf", "1"): (
        "test_opd_teachers_served_vllm.py",
        "test_whitebox_with_teacher_logprobs_topk_runs_against_a_generation_server",
    ),
    ("served, top-K", "episodes", "hf", "1"): (
        "test_jobs_whitebox_transcripts.py",
        "test_a_served_topk_teacher_over_transcripts_is_the_teachers_topk_at_the_students_positions",
    ),
    ("another tokenizer", "single-turn", "hf", "1"): (
        "test_jobs_whitebox.py",
        "test_a_teacher_with_another_tokenizer_trains_the_student",
    ),
    ("another tokenizer", "single-turn", "hf", "2 fsdp"): (
        "test_run_sharding.py",
        "test_fsdp_with_a_teacher_of_another_tokenizer_gives_the_one_process_loss_and_first_update",
    ),
    ("another tokenizer", "single-turn", "vllm", "1"): (
        "test_rollout_engines_vllm.py",
        "test_a_teacher_with_another_tokenizer_takes_vllm_rollouts",
    ),
    ("another tokenizer", "episodes", "hf", "1"): (
        "test_opd_teachers_cross_retokenize_transcripts.py",
        "test_the_loss_over_a_transcript_equals_the_direct_computation_on_the_students_turns",
    ),
    ("another tokenizer, served", "single-turn", "hf", "1"): (
        "test_jobs_whitebox_served.py",
        "test_a_served_teacher_with_another_tokenizer_takes_the_in_process_first_update",
    ),
    ("another tokenizer, served", "episodes", "hf", "1"): (
        "test_jobs_whitebox_transcripts.py",
        "test_a_served_teacher_of_another_tokenizer_over_transcripts_takes_the_in_process_first_update",
    ),
    ("a set (weighted)", "single-turn", "hf", "1"): (
        "test_jobs_whitebox_served.py",
        "test_whitebox_with_two_weighted_teachers_logs_each_and_refuses_a_resume_with_another_set",
    ),
    ("defended (top-K 5)", "single-turn", "hf", "1"): (
        "test_opd_teachers_defended.py",
        "test_defended_run_s_first_update_is_the_attacker_s_loss_on_the_defended_scores",
    ),
}


@dataclass(frozen=True)
class Combination:
    kind: str
    source: str
    engine: str
    processes: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.kind, self.source, self.engine, self.processes)

    def settings(self) -> dict:
        """The whitebox settings that give this combination (over the `tiny` preset), as a dry run."""
        kind = KINDS[self.kind][0]
        return {**kind, **SOURCES[self.source], **ENGINES[self.engine], **PROCESSES[self.processes]}

    def refusal(self) -> str | None:
        """The line the job's checks refuse this combination with (the settings' own, then
        `check_combination`'s), or None where they take it."""
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # a dry run's notes (no vllm here, no GPU)
                cfg = load_config(WhiteboxConfig, "tiny", {**self.settings(), "dry_run": True})
                check_combination(cfg, KINDS[self.kind][1])
        except ConfigError as e:
            return str(e)
        return None


def combinations() -> list[Combination]:
    """Every combination, kind by kind, then source, engine and processes."""
    return [Combination(k, s, e, p) for k in KINDS for s in SOURCES for e in ENGINES for p in PROCESSES]


def statuses() -> dict[Combination, tuple[str, str | None]]:
    """Each combination's ("tested", its test), ("built", None) or ("refused", the line); a combination with
    a test that the checks refuse is an error (the table would contradict itself)."""
    out = {}
    for c in combinations():
        line, test = c.refusal(), "::".join(TESTED[c.key]) if c.key in TESTED else None
        if line is not None and test is not None:
            raise ValueError(f"{c.key} is refused ({line}) and names the test {test}")
        out[c] = ("refused", line) if line is not None else ("tested", test) if test else ("built", None)
    return out


def table() -> str:
    """The markdown table (rows: teacher kind and rollout source; columns: engine and processes), each cell
    `tested (Tn)`, `built` (taken by the checks, no test runs that very combination) or `refused (Rn)`, and
    the tests and the refusals' lines by number below it."""
    found = statuses()
    tests: list[str] = []
    lines: list[str] = []
    columns = [(e, p) for e in ENGINES for p in PROCESSES]
    head = "| teacher kind | rollout source | " + " | ".join(f"{e}, {p}" for e, p in columns) + " |"
    out = [head, "|---|---|" + "---|" * len(columns)]
    for k in KINDS:
        for s in SOURCES:
            cells = []
            for e, p in columns:
                status, what = found[Combination(k, s, e, p)]
                if status == "built":
                    cells.append("built")
                    continue
                known = tests if status == "tested" else lines
                if what not in known:
                    known.append(what)
                cells.append(f"{status} ({'T' if status == 'tested' else 'R'}{known.index(what) + 1})")
            out.append(f"| {k} | {s} | " + " | ".join(cells) + " |")
    out += ["", "Tests (in `tests/`):", ""]
    out += [f"- T{i}: `{t}`" for i, t in enumerate(tests, 1)]
    out += ["", "Refusals (the line the run stops with, before its folder is written):", ""]
    out += [f"- R{i}: {line}" for i, line in enumerate(lines, 1)]
    return "\n".join(out) + "\n"


BEGIN, END = "<!-- combinations: begin -->", "<!-- combinations: end -->"


def write_into(path: Path) -> None:
    """Replaces what stands between `BEGIN` and `END` in the file at `path` by `table()`."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ConfigError(f"{path} has no {BEGIN} ... {END} block to write the table into.")
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    path.write_text(f"{before}{BEGIN}\n{table()}{END}{after}")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args:
        write_into(Path(args[0]))
    else:
        print(table(), end="")


if __name__ == "__main__":
    main()
