"""The clip-vs-noclip lesson: arm composition, the phenomenon on several seeds, existing runs."""

from __future__ import annotations

import pytest

from opdkit.config import ConfigError, load_config
from opdkit.jobs import cliplesson, whitebox
from opdkit.jobs.cliplesson import job as cliplesson_job
from opdkit.jobs.cliplesson import report as cliplesson_report
from opdkit.jobs.cliplesson.arms import arm_overrides, lesson_summary
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.run.folders import RunDir


def test_tiny_arms_follow_the_presets_and_change_one_thing_each():
    cfg = load_config(ClipLessonConfig, "tiny")
    arms = {a.name: a for a in cliplesson.arms(cfg)}
    clip, noclip = load_config(WhiteboxConfig, "tiny"), load_config(WhiteboxConfig, "tiny-noclip")
    assert noclip.learning_rate == pytest.approx(5 * clip.learning_rate), "noclip is lr x5, as the original"
    assert arms["clip"].clipping and not arms["noclip"].clipping
    assert (arms["clip-at-noclip-lr"].learning_rate, arms["clip-at-noclip-lr"].clipping) == (
        noclip.learning_rate,
        True,
    )
    assert (arms["noclip-at-clip-lr"].learning_rate, arms["noclip-at-clip-lr"].clipping) == (
        clip.learning_rate,
        False,
    )
    sgd = [arms["sgd-clip"], arms["sgd-noclip"]]
    assert sgd[0].learning_rate == sgd[1].learning_rate and sgd[0].clipping and not sgd[1].clipping
    assert sgd[0].overrides["optim"] == "sgd"


def test_every_arm_takes_the_lessons_teacher_server():
    url = "http://node7:8000"
    cfg = load_config(ClipLessonConfig, "tiny", {"teacher_server": url, "teacher_server_dtype": "float32"})
    for arm in cliplesson.arms(cfg):
        arm_cfg = load_config(WhiteboxConfig, arm.mode, arm_overrides(arm, cfg))
        assert (arm_cfg.teacher_server, arm_cfg.teacher_server_dtype) == (url, "float32")
        assert "teacher head (served teacher)" in whitebox.memory_plan(arm_cfg, None).table()
    arm = cliplesson.arms(load_config(ClipLessonConfig, "tiny"))[0]
    assert "teacher_server" not in arm_overrides(arm, load_config(ClipLessonConfig, "tiny"))


def test_full_lesson_compares_sanity_with_noclip():
    cfg = load_config(ClipLessonConfig, "full")
    arms = {a.name: a for a in cliplesson.arms(cfg)}
    assert set(arms) == {"clip", "noclip"}
    assert (arms["clip"].mode, arms["noclip"].mode) == ("sanity", "noclip")
    assert (arms["clip"].learning_rate, arms["noclip"].learning_rate) == (1e-6, 5e-6)


def test_repeats_give_every_arm_its_seeds_and_are_declared_once():
    prep = cliplesson.prepare("tiny", {"repeats": 3, "seed": 7})
    assert prep.seeds == [7, 8, 9]
    with pytest.raises(ConfigError, match="repeats=0 is below"):
        load_config(ClipLessonConfig, "tiny", {"repeats": 0})
    with pytest.raises(ConfigError, match="unknown setting 'seeds' for cliplesson"):
        load_config(ClipLessonConfig, "tiny", {"seeds": "1,2"})


def test_lesson_summary_pairs_the_arms_by_seed():
    """Synthetic arms: clip ahead of noclip by 20 points at every seed (the seeds move both together), the
    SGD pair within noise; the findings say so, each arm's figures are means with intervals."""

    def stats(acc: float, loss: float) -> dict:
        return {"final_accuracy": acc, "max_loss": loss, "clipping": True, "learning_rate": 1e-3}

    base = {1: 0.5, 2: 0.7, 3: 0.9}
    results = {
        "clip": {s: stats(a, 1.0) for s, a in base.items()},
        "noclip": {s: stats(a - 0.2, 3.0 + s) for s, a in base.items()},
        "sgd-clip": {s: stats(a, 1.0) for s, a in base.items()},
        "sgd-noclip": {s: stats(a + d, 1.0) for (s, a), d in zip(base.items(), (0.05, -0.04, 0.01))},
    }
    summary = lesson_summary(results)
    assert summary["repeats"] == 3 and set(summary["arms"]) == set(results)
    noclip = summary["arms"]["noclip"]
    assert noclip["final_accuracy"] == pytest.approx(0.5) and noclip["max_loss"] == pytest.approx(5.0)
    low, high = noclip["final_accuracy_ci"]
    assert low < 0.3 and high > 0.7  # the arm's own interval is wide ...
    found = {(f["arm"], f["against"]): f for f in summary["findings"]}
    head = found[("clip", "noclip")]  # ... its paired difference is not
    assert head["word"] == "holds" and head["mean"] == pytest.approx(0.2) and head["n"] == 3
    assert found[("sgd-clip", "sgd-noclip")]["word"] == "within noise at 3 seeds"
    assert summary["findings"][0] is head  # the headline comes first
    text = cliplesson_report.explain(summary)
    assert text.startswith("**Finding.** the clipped arm ends more accurate") and "**holds**" in text


@pytest.mark.slow
def test_noclip_blows_up_and_clip_trains_smoothly_on_three_seeds(tmp_path):
    """The original's phenomenon, for real: no smoothing, no cherry-picked seed."""
    lesson = cliplesson.run(
        "tiny",
        {
            "run_dir": str(tmp_path / "l"),
            "seed": 1,
            "repeats": 3,
            "ablations": False,
            "sgd_arms": False,
            "arm_max_steps": 60,
            "arm_eval_size": 150,
        },
    )
    s = lesson.read_summary()
    for seed in (1, 2, 3):
        clip, noclip = s["arms"]["clip"]["seeds"][str(seed)], s["arms"]["noclip"]["seeds"][str(seed)]
        assert noclip["max_loss"] > 2 * clip["max_loss"], seed
        assert noclip["final_accuracy"] < clip["final_accuracy"], seed
        assert clip["max_loss"] < 2.5 and clip["final_loss"] < 0.6 * clip["max_loss"], seed
        assert clip["clipped_steps"] > 0 and noclip["clipped_steps"] == 0


def test_existing_runs_can_be_the_arms(tmp_path):
    base = {"max_steps": 2, "eval_size": 8, "sample_every": 1, "checkpoint_every": 0}
    c = whitebox.run("tiny", {**base, "run_dir": str(tmp_path / "c")})
    n = whitebox.run("tiny-noclip", {**base, "run_dir": str(tmp_path / "n")})
    lesson = cliplesson.run(
        "tiny", {"run_dir": str(tmp_path / "l"), "clip_run": str(c.path), "noclip_run": str(n.path)}
    )
    s = lesson.read_summary()
    assert set(s["arms"]) == {"clip", "noclip"}
    for arm in s["arms"].values():
        assert set(arm) >= {
            "max_grad_norm",
            "median_grad_norm",
            "clipped_steps",
            "max_loss",
            "final_loss",
            "final_accuracy",
            "first_nonfinite_step",
            "learning_rate",
            "clipping",
        }
    assert s["arms"]["clip"]["clipping"] and not s["arms"]["noclip"]["clipping"]
    assert "within noise at 1 seed" in cliplesson_report.explain(s)  # one seed: no interval, no verdict
    step, near = cliplesson_report.spike_samples(s, "noclip")
    assert step in (1, 2) and near


def test_missing_partner_run_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="noclip_run"):
        cliplesson.run("tiny", {"run_dir": str(tmp_path / "l"), "clip_run": str(tmp_path)})


def test_resume_reuses_finished_arms_and_resumes_the_others(tmp_path, monkeypatch):
    """With resume=True an arm whose run finished is reused as it is, an unfinished one continues (its
    whitebox run resumes from its newest complete checkpoint), and one not started starts."""
    from opdkit.run.folders import RunDir

    started = []
    monkeypatch.setattr(whitebox, "run", lambda mode, over, **kw: started.append(over) or RunDir(tmp_path))
    cfg = load_config(ClipLessonConfig, "tiny", {"resume": True})
    clip, noclip = cliplesson_job.arms(cfg)[:2]
    lesson = RunDir(tmp_path)
    for arm, status in ((clip, "done"), (noclip, "training")):
        folder = tmp_path / "arms" / f"{arm.name}-seed42"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(f'{{"status": "{status}"}}')
    assert cliplesson_job.run_arm(clip, 42, cfg, lesson).path == tmp_path / "arms" / "clip-seed42"
    assert started == []
    cliplesson_job.run_arm(noclip, 42, cfg, lesson)
    cliplesson_job.run_arm(clip, 43, cfg, lesson)
    assert [o.get("resume") for o in started] == [True, None]


def test_the_arms_of_one_seed_prepare_their_inputs_once(tmp_path, monkeypatch):
    """The arms of a seed share whitebox's prepared inputs (the prompts measured once), each run still with
    its own settings and folder; another seed prepares its own (its shuffle differs)."""
    from opdkit.jobs.whitebox.inputs import Prepared

    prepared_for, ran = [], []

    def prepare(mode, over):
        prepared_for.append(over["seed"])
        return Prepared(load_config(WhiteboxConfig, mode, over), mode, None, None, [], [], [], 0, "")

    monkeypatch.setattr(whitebox, "prepare", prepare)
    monkeypatch.setattr(whitebox, "run", lambda mode, over, prepared, **kw: ran.append(prepared))
    cfg = load_config(ClipLessonConfig, "tiny")
    arms = cliplesson_job.arms(cfg)
    inputs, lesson = cliplesson_job.SharedInputs(), RunDir(tmp_path)
    for arm in arms:
        cliplesson_job.run_arm(arm, 42, cfg, lesson, inputs)
    cliplesson_job.run_arm(arms[0], 43, cfg, lesson, inputs)
    assert prepared_for == [42, 43]
    own = [load_config(WhiteboxConfig, a.mode, {**arm_overrides(a, cfg), "seed": 42}) for a in arms]
    assert [(p.cfg.learning_rate, p.cfg.max_grad_norm, p.cfg.optim) for p in ran[:-1]] == [
        (c.learning_rate, c.max_grad_norm, c.optim) for c in own
    ]
    assert len({c.optim for c in own}) == 2 and len({c.learning_rate for c in own}) == 3
    assert [p.cfg.run_dir for p in ran] == [
        str(tmp_path / "arms" / f"{a.name}-seed{s}") for a, s in [(a, 42) for a in arms] + [(arms[0], 43)]
    ]
    assert len({id(p.train_dataset) for p in ran[:-1]}) == 1 and ran[-1].cfg.seed == 43


@pytest.mark.slow
def test_the_lesson_takes_a_teacher_with_another_tokenizer(tmp_path):
    """Arms from the tiny-crosstok presets: every arm distils through the cross-tokenizer loss."""
    over = {
        "run_dir": str(tmp_path / "l"),
        "clip_mode": "tiny-crosstok",
        "noclip_mode": "tiny-crosstok-noclip",
        "ablations": False,
        "sgd_arms": False,
        "arm_max_steps": 2,
        "arm_eval_size": 8,
    }
    assert load_config(WhiteboxConfig, "tiny-crosstok").teacher_model == "tiny:teacher-bpe"
    s = cliplesson.run("tiny", over).read_summary()
    assert set(s["arms"]) == {"clip", "noclip"}
    for arm in s["arms"].values():
        (stats,) = arm["seeds"].values()
        run = RunDir.attach(stats["run_dir"])
        records = [r for r in run.read_jsonl() if "loss" in r]
        assert len(records) == 2 and all(r["entropy"] is None for r in records)  # cross-tokenizer rows
        assert run.read_summary()["teacher_accuracy"] >= 0.75  # the teacher decodes with its own tokenizer


def test_a_dry_run_checks_the_arms_inputs_once(monkeypatch):
    """A dry run checks whitebox's inputs for its arms, which differ only in training settings: prepared once,
    not once per arm."""
    from opdkit.jobs.whitebox.inputs import Prepared

    prepared_for = []

    def prepare(mode, over):
        prepared_for.append((mode, over))
        return Prepared(load_config(WhiteboxConfig, mode, over), mode, None, None, [], [], [], 0, "")

    monkeypatch.setattr(whitebox, "prepare", prepare)
    cfg = load_config(ClipLessonConfig, "tiny", {"dry_run": True})
    prep = cliplesson_job.prepared(cfg, "tiny")
    assert len(prep.arms) > 2 and len(prepared_for) == 1
    assert prepared_for[0][1]["dry_run"] is True


def test_a_dry_run_loads_each_tokenizer_once(monkeypatch, capsys):
    """03's dry run prepares its arms and plans each (the teacher's token ratio): every tokenizer is read from
    its files once (a Qwen3 tokenizer took 0.7 s a load, eight loads in 03 full's dry run)."""
    from opdkit import models

    reads, read = [], models.AutoTokenizer.from_pretrained
    monkeypatch.setattr(models, "_LOADED", {})
    monkeypatch.setattr(
        models.AutoTokenizer, "from_pretrained", lambda path, **kw: reads.append(path) or read(path, **kw)
    )
    assert cliplesson.run("tiny", {"dry_run": True, "ablations": False, "sgd_arms": False}) is None
    assert "memory plan per process, stages clip" in capsys.readouterr().out
    # The tiny student and teacher ship the same tokenizer files: one read serves both.
    wanted = {models.resolve(m) for m in ("tiny:student", "tiny:teacher")}
    assert len(reads) == 1 and set(reads) <= wanted
