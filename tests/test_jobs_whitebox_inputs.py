"""Held-out evaluation sets never share a prompt with the training prompts, whatever subset_size is, by text
(a file may repeat a prompt, as raw DAPO-Math-17k does); training prompts stay off a gradient's holdout."""

import random
from types import SimpleNamespace

import datasets
import pytest

from opdkit import tasks
from opdkit.config import ConfigError
from opdkit.data import prompts
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.whitebox.inputs import split_prompts
from opdkit.run.folders import RunDir


def _texts(messages) -> list[str]:
    return [m[-1]["content"] for m in messages]


def _split(path, subset_size, eval_size, seed, exclude=frozenset()):
    cfg = SimpleNamespace(
        dataset_path=str(path), dataset_split="train", subset_size=subset_size, eval_size=eval_size, seed=seed
    )
    return split_prompts(tasks.get_task("math"), cfg, exclude)


@pytest.fixture(scope="module")
def repeated_parquet(tmp_path_factory) -> str:
    """40 problems, each five times in a shuffled order (raw DAPO-Math-17k holds each about 100 times); one
    copy in five differs only by whitespace."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?" if k else f"What  is {i} +\n{i}? "}],
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
        }
        for i in range(40)
        for k in range(5)
    ]
    random.Random(0).shuffle(rows)
    path = tmp_path_factory.mktemp("repeated") / "dapo-raw.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def _savegrad_run(tmp_path, dataset_path: str, seed: int) -> str:
    """A savegrad run folder as other jobs read it: its config.yaml (the holdout is rebuilt from it)."""
    cfg = SaveGradConfig(
        dataset_path=dataset_path, holdout_fraction=0.3, subset_size=-1, seed=seed, run_dir=str(tmp_path)
    )
    return str(RunDir.create(cfg, job="savegrad", mode="tiny").path)


@pytest.mark.parametrize("subset_size,eval_size", [(-1, 3), (-1, 1), (5, 3), (9, 3), (5, 100)])
def test_math_eval_rows_are_apart_from_training(dapo_parquet, subset_size, eval_size):
    path = str(dapo_parquet)
    split = _split(path, subset_size, eval_size, 42)
    train, held, answers = _texts(split.train["messages"]), split.eval_messages, split.eval_answers
    everything = _texts(tasks.get_task("math").load_prompts(path, "train", -1, 42)["messages"])
    assert not set(train) & set(_texts(held))
    assert len(held) == len(answers) == min(eval_size, len(everything) - len(train))
    expected_train = len(everything) - eval_size if subset_size == -1 else subset_size
    assert len(train) == expected_train and set(train) | set(_texts(held)) <= set(everything)


def test_whole_file_with_eval_leaves_the_eval_rows_out(dapo_parquet):
    """subset_size=-1 used to train on every row and evaluate on the last eval_size of them."""
    split = _split(dapo_parquet, -1, 4, 0)
    train, held = split.train, split.eval_messages
    assert len(train) == 8 and len(held) == 4
    assert not set(_texts(train["messages"])) & set(_texts(held))


@pytest.mark.parametrize("subset_size,eval_size", [(-1, 12), (12, 1), (20, 5)])
def test_no_room_for_held_out_rows_is_an_error(dapo_parquet, subset_size, eval_size):
    with pytest.raises(ConfigError, match="too few"):
        _split(dapo_parquet, subset_size, eval_size, 42)


def test_whitebox_prepare_uses_the_split(dapo_parquet, tiny_tokenizer, monkeypatch):
    from opdkit.jobs.whitebox import inputs as wb_prepare
    from opdkit.jobs.whitebox import job

    monkeypatch.setattr(wb_prepare, "load_tokenizer", lambda name: tiny_tokenizer)
    monkeypatch.setattr(wb_prepare, "check_tokenizers", lambda a, b: None)
    prep = job.prepare(
        "tiny",
        {"dataset_path": str(dapo_parquet), "subset_size": -1, "eval_size": 2, "max_prompt_length": 100_000},
    )
    assert not set(_texts(prep.train_messages)) & set(_texts(prep.eval_messages))
    assert len(prep.train_dataset) == 10 and len(prep.eval_messages) == 2


@pytest.mark.parametrize("subset_size,kind", [(-1, "train_in_eval"), (30, "eval_in_train")])
def test_repeated_prompts_never_reach_both_sets(repeated_parquet, subset_size, kind):
    split = _split(repeated_parquet, subset_size, 10, 42)
    train = prompts.prompt_keys(split.train["messages"])
    held = [prompts.prompt_key(m) for m in split.eval_messages]
    assert len(held) == len(set(held)) == 10 and not train & set(held)
    assert split.removed[kind] > 0  # by row, these would have been in both sets
    if subset_size == -1:  # every copy of an evaluation prompt left training, the other rows stayed
        assert len(split.train) + split.removed["train_in_eval"] == 200 - 10


def test_prompt_key_ignores_whitespace_and_the_system_prompt():
    a = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 +\n 2?"}]
    assert prompts.prompt_key(a) == prompts.prompt_key([{"role": "user", "content": " What is 2 + 2?"}])
    assert prompts.prompt_key(a) != prompts.prompt_key([{"role": "user", "content": "What is 2 + 3?"}])


def test_whitebox_leaves_savegrads_holdout_out_when_told(dapo_parquet, tiny_tokenizer, monkeypatch, tmp_path):
    from opdkit.jobs import savegrad
    from opdkit.jobs.whitebox import inputs as wb_prepare
    from opdkit.jobs.whitebox import job

    monkeypatch.setattr(wb_prepare, "load_tokenizer", lambda name: tiny_tokenizer)
    monkeypatch.setattr(wb_prepare, "check_tokenizers", lambda a, b: None)
    grads = _savegrad_run(tmp_path / "grads", str(dapo_parquet), seed=7)  # another seed: another holdout
    holdout = prompts.prompt_keys(savegrad.run_holdout(grads))
    over = {"dataset_path": str(dapo_parquet), "subset_size": -1, "eval_size": 2, "max_prompt_length": 10**5}
    blind = job.prepare("tiny", over)
    assert prompts.overlap_count(blind.train_messages, holdout) > 0
    assert job.overlap_facts(blind.cfg, blind)["exclude_run"].startswith("not given")
    told = job.prepare("tiny", {**over, "exclude_run": grads})
    assert prompts.overlap_count(told.train_messages, holdout) == 0
    assert told.removed["train_in_excluded"] > 0
    assert not prompts.prompt_keys(told.train_messages) & prompts.prompt_keys(told.eval_messages)
    assert job.overlap_facts(told.cfg, told) == {
        "prompts_removed_for_overlap": told.removed,
        "exclude_run": grads,
    }


def test_antidistill_one_file_for_both_sets(repeated_parquet, tiny_tokenizer, monkeypatch):
    from opdkit.jobs.antidistill import job, sweep

    monkeypatch.setattr(sweep, "load_tokenizer", lambda name: tiny_tokenizer)
    # Not about the gradient: tiny's grads_mode cannot cut a holdout from a file (each prompt here repeats).
    monkeypatch.setattr(sweep, "check_grads_run", lambda cfg, tok: None)
    monkeypatch.setattr(sweep, "check_apart_from_gradient", lambda cfg, messages: "not checked")
    prep = job.prepare(
        "tiny",
        {
            "dataset_path": repeated_parquet,
            "eval_dataset_path": repeated_parquet,
            "eval_dataset_split": "train",
            "subset_size": 30,
            "eval_size": 10,
            "max_prompt_length": 10**5,
        },
    )
    held = [prompts.prompt_key(m) for m in prep.eval_messages]
    assert len(held) == len(set(held)) == 10
    assert not prompts.prompt_keys(prep.train_messages) & set(held)
    assert prep.removed["eval_in_train"] > 0  # the head of the same shuffle: every row was a training row


def test_antidistill_refuses_a_gradient_holdout_it_trains_on(dapo_parquet, tmp_path, monkeypatch):
    from opdkit.jobs import antidistill, savegrad
    from opdkit.jobs.antidistill import sweep

    monkeypatch.setattr(sweep, "check_grads_run", lambda cfg, tok: None)  # a config-only savegrad run

    grads = _savegrad_run(tmp_path / "grads", str(dapo_parquet), seed=7)  # another seed: another tail
    shared = prompts.overlap_count(
        prompts.load_prompts(str(dapo_parquet), "train", 6, 42)["messages"],
        prompts.prompt_keys(savegrad.run_holdout(grads)),
    )
    assert shared > 0
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"{shared} of the 6 training prompts are in the holdout"):
        antidistill.run(
            "tiny",
            {
                "dataset_path": str(dapo_parquet),
                "subset_size": 6,
                "eval_dataset_path": str(dapo_parquet),
                "eval_dataset_split": "train",
                "eval_size": 3,
                "grads_run": grads,
                "run_dir": str(run_dir),
            },
        )
    assert not run_dir.exists()


def test_antidistill_accepts_the_holdout_of_its_own_shuffle(dapo_parquet, tmp_path):
    """The same file and seed: savegrad's holdout is the tail, the training prompts the head."""
    from opdkit.config import load_config
    from opdkit.jobs.antidistill import sweep
    from opdkit.jobs.antidistill.config import AntidistillConfig

    grads = _savegrad_run(tmp_path / "grads", str(dapo_parquet), seed=42)
    cfg = load_config(
        AntidistillConfig, "tiny", {"dataset_path": str(dapo_parquet), "subset_size": 8, "grads_run": grads}
    )
    task = tasks.for_dataset(cfg.dataset_path)
    sweep.check_apart_from_gradient(cfg, sweep.training_prompts(cfg, task)[0])  # no ConfigError


def test_a_bare_gradient_file_is_used_unchecked_and_the_summary_says_so(tmp_path):
    from opdkit.config import load_config
    from opdkit.jobs.antidistill import sweep
    from opdkit.jobs.antidistill.config import AntidistillConfig

    cfg = load_config(AntidistillConfig, "tiny", {"grads_run": str(tmp_path)})
    assert sweep.check_apart_from_gradient(cfg, []).startswith("not checked")


def test_multi_turn_episodes_take_every_teacher_kind_and_refuse_a_sharded_student():
    """environment with any teacher kind (in process, served exactly or top-K, another tokenizer), sampled in
    the step or ahead: none refused; with parallelism fsdp over 2 processes, one line."""
    from opdkit.jobs.whitebox.config import WhiteboxConfig
    from opdkit.jobs.whitebox.inputs import check_environment

    for over in (
        {},
        {"teacher_model": "tiny:teacher-bpe"},
        {"teacher_server": "http://x:1"},
        {"teacher_server": "http://x:1", "teacher_logprobs": "topk:20"},
        {"rollout_ahead": 1},
    ):
        check_environment(WhiteboxConfig(environment="calculator", **over))
    sharded = WhiteboxConfig(environment="calculator", parallelism="fsdp", num_processes=2)
    with pytest.raises(ConfigError, match="use parallelism ddp, or no environment") as err:
        check_environment(sharded)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "mode, sets, says",
    [
        (
            "tiny-crosstok",
            ["rollout_ahead=1", "async_correction=truncated"],
            "async_correction=truncated weights the exact divergence per token, and the cross-tokenizer loss",
        ),
        (
            "tiny",
            ["rollout_ahead=1", "rollout_device=cuda:3"],
            "rollout_device=cuda:3 places the rollout producer",
        ),
    ],
    ids=["correction-crosstok", "absent-gpu"],
)
def test_sampling_ahead_that_cannot_run_is_refused_in_one_line_before_the_run_folder(
    tmp_path, monkeypatch, capsys, mode, sets, says
):
    """issue 47, item 5: a corrected run with a teacher whose divergence takes no weights, and a producer
    on a GPU this machine lacks, are refused by the job's cheap checks: one line, exit status 2, nothing
    written (the run folder goes under the working folder)."""
    import torch

    from opdkit import whitebox

    if torch.cuda.device_count() > 3 and mode == "tiny":
        pytest.skip("this machine has a cuda:3")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        whitebox.main(["--mode", mode, "--set", *sets])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err and err.startswith("error: ") and says in err, err
    assert list(tmp_path.iterdir()) == []
