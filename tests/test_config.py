"""Configuration: presets, notebook parameter cells, and the files that must agree."""

from __future__ import annotations

import ast
import importlib
import json
import re
from dataclasses import fields
from pathlib import Path

import pytest
import tomllib
import yaml
from helpers import CONFIGS

from opdkit import config
from opdkit.config import ConfigError, load_config
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.notebook.parameters import notebook_parameters

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def all_presets():
    return [(job, mode) for job, cls in CONFIGS.items() for mode in config.available_modes(cls)]


@pytest.mark.parametrize("job,mode", all_presets())
def test_every_preset_loads_and_validates(job, mode):
    cfg = load_config(CONFIGS[job], mode)
    assert isinstance(cfg, CONFIGS[job])


def test_every_job_has_a_tiny_default():
    for job, cls in CONFIGS.items():
        assert config.DEFAULT_MODE in config.available_modes(cls), job


def test_full_whitebox_preset_is_the_original_configuration():
    cfg = load_config(WhiteboxConfig, "full")
    expected = dict(
        student_model="Qwen/Qwen3-0.6B",
        teacher_model="Qwen/Qwen3-4B",
        dataset_path="data/dapo-math-17k-unique.parquet",
        subset_size=1000,
        seed=42,
        max_prompt_length=1024,
        rollout_max_new_tokens=1024,
        enable_thinking=False,
        beta=1.0,
        kl_temperature=1.0,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        learning_rate=1e-6,
        per_device_train_batch_size=4,
        global_batch_size=64,  # the original's 4 per GPU x 4 GPUs x 4 accumulation
        num_train_epochs=1.0,
        max_steps=-1,
        max_grad_norm=1.0,
        bf16=True,
        logging_steps=1,
        checkpoint_every=100,
        save_total_limit=2,
        report_to="none",
    )
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.rollout_engine == "vllm", (
        "full runs sample through vLLM (the kit's loop: -p rollout_engine hf)"
    )
    sanity, noclip = load_config(WhiteboxConfig, "sanity"), load_config(WhiteboxConfig, "noclip")
    assert sanity.max_steps == 50 and sanity.learning_rate == 1e-6
    assert (noclip.max_steps, noclip.max_grad_norm, noclip.learning_rate) == (15, 1e9, 5e-6)


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ConfigError, match=r"unknown mode 'nope'.*tiny"):
        load_config(WhiteboxConfig, "nope")


def test_unknown_key_names_offender_and_suggests():
    with pytest.raises(
        ConfigError, match=r"^unknown setting 'learning_rat' for whitebox; did you mean learning_rate\?$"
    ):
        load_config(WhiteboxConfig, "tiny", {"learning_rat": 1e-3})


def test_range_checks_name_the_field():
    with pytest.raises(ConfigError, match="beta=1.5"):
        load_config(WhiteboxConfig, "tiny", {"beta": 1.5})
    with pytest.raises(ConfigError, match="normalization"):
        load_config(SaveGradConfig, "tiny", {"normalization": "batch"})


def test_overrides_are_coerced_and_none_keeps_preset():
    cfg = load_config(WhiteboxConfig, "tiny", {"learning_rate": 1, "max_steps": "7", "beta": None})
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)
    assert cfg.max_steps == 7 and cfg.beta == load_config(WhiteboxConfig, "tiny").beta


def test_extends_inherits_and_overrides(tmp_path):
    (tmp_path / "whitebox").mkdir()
    (tmp_path / "whitebox" / "a.yaml").write_text("max_steps: 5\nbeta: 0.5\n")
    (tmp_path / "whitebox" / "b.yaml").write_text("extends: a\nbeta: 0.0\n")
    cfg = load_config(WhiteboxConfig, "b", params_dir=tmp_path)
    assert (cfg.max_steps, cfg.beta) == (5, 0.0)


def test_every_field_has_help():
    for cls in CONFIGS.values():
        for f in fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_notebook_parameters_reject_unknown_names():
    """The command line's line (`check_keys`): the closest names, or where the full list is; `mode` is a
    parameter of the notebook, not a setting."""
    cell = "the notebook's parameters cell"
    with pytest.raises(ConfigError) as err:
        notebook_parameters(WhiteboxConfig, {"mode": "tiny", "max_steps": 5, "learning_rat": 0.1})
    assert str(err.value) == (
        f"unknown setting 'learning_rat' for whitebox in {cell}; did you mean learning_rate?"
    )
    with pytest.raises(ConfigError) as err:
        notebook_parameters(WhiteboxConfig, {"mode": "tiny", "bogus": 1})
    assert str(err.value) == (
        f"unknown setting 'bogus' for whitebox in {cell}; python -m opdkit.whitebox --help lists them."
    )
    mode, over = notebook_parameters(WhiteboxConfig, {"mode": "full", "learning_rate": None, "In": []})
    assert mode == "full" and over == {"learning_rate": None}


def test_notebook_parameters_come_from_the_parameters_cell_not_globals():
    params = 'mode: str = "tiny"  # preset\nmax_steps: int = 5  # steps\nseed: int = None  # seed'
    config_cell = "mode, overrides = notebook_parameters(WhiteboxConfig, globals())"
    first_run = ["", params, config_cell, "scratch = 1"]
    namespace = {"In": first_run, "mode": "tiny", "max_steps": 5, "seed": None, "scratch": 1, "cfg": object()}
    assert notebook_parameters(WhiteboxConfig, namespace) == ("tiny", {"max_steps": 5, "seed": None})
    # Run all again with max_steps edited and seed deleted: the globals still hold both old values.
    edited = 'mode: str = "tiny"\nmax_steps: int = 7\nlearning_rate = 2 * 1e-3'
    namespace["In"] = first_run + [edited, config_cell]
    assert notebook_parameters(WhiteboxConfig, namespace) == ("tiny", {"max_steps": 7, "learning_rate": 2e-3})
    # papermill's injected cell runs after the parameters cell and wins; an unknown name is refused.
    injected = '# Parameters\nmax_steps = 3\nmode = "full"\n'
    namespace["In"] = first_run + [params, injected, config_cell]
    assert notebook_parameters(WhiteboxConfig, namespace) == ("full", {"max_steps": 3, "seed": None})
    namespace["In"] = first_run + [params, injected + "bogus = 1\n", config_cell]
    with pytest.raises(ConfigError, match="bogus"):
        notebook_parameters(WhiteboxConfig, namespace)


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _job_of(path: Path) -> str:
    return path.stem


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_clean_with_one_parameters_cell(path):
    cells = _cells(path)
    assert not any(c.get("outputs") for c in cells), "commit notebooks without outputs"
    assert not any(c.get("execution_count") for c in cells), "commit notebooks without execution counts"
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1


@pytest.mark.parametrize("path,job", zip(NOTEBOOKS, CONFIGS), ids=lambda p: getattr(p, "name", p))
def test_notebook_parameters_are_fields_and_documented(path, job):
    cell = next(c for c in _cells(path) if "parameters" in c.get("metadata", {}).get("tags", []))
    source = "".join(cell["source"])
    tree = ast.parse(source)
    names = [n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)]
    assert len(names) == len(tree.body), "every parameter is an annotated assignment"
    valid = set(config.field_names(CONFIGS[job])) | config.NOTEBOOK_ONLY
    assert set(names) <= valid, set(names) - valid
    assert {"mode", "run_dir"} <= set(names)
    for line in source.splitlines():
        if line.startswith("#"):  # a commented-out field a GPU user sets, or a heading for them
            name = re.match(r"#\s*(\w+)\s*:\s*\w+\s*=", line)
            assert name is None or name.group(1) in valid, f"commented-out {line!r} is no field"
            continue
        comment = line.split("#", 1)[1] if "#" in line else ""
        assert comment.strip(), f"parameter without a comment: {line}"
        assert "=" not in comment, f"papermill's parser breaks on '=' in a comment: {line}"
    assert re.search(r"^# \w+: \w+ = ", source, re.M), "show the fields a GPU user sets, commented out"
    mode_line = next(line for line in source.splitlines() if line.startswith("mode"))
    assert re.search(r'"tiny"', mode_line), "the default mode is the tiny preset"


def test_environment_yml_matches_pyproject():
    """environment.yml: conda gives Python and pip only (no conda torch under the pip vLLM); its pip list
    names every dependency of pyproject's and pins torch, vllm and transformers as the `vllm` extra does."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(req: str) -> str:
        return re.split(r"[<>=!~ ;\[]", req)[0].lower()

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert {name(d) for d in conda} == {"python", "pip"}, "only python and pip come from conda"
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    reqs = [r for r in pip if not r.startswith("-e")]
    assert {name(r) for r in reqs} - {"vllm"} == {name(d) for d in project["dependencies"]}
    extra = {name(r): r.replace(" ", "") for r in project["optional-dependencies"]["vllm"]}
    assert set(extra) == {"vllm", "torch", "transformers"}
    assert all("==" in extra[n] for n in ("vllm", "torch")), "the pair is pinned exactly"
    assert {name(r): r.replace(" ", "") for r in reqs if name(r) in extra} == extra
    assert '-e ".[vllm]"' in pip


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("module", ["savegrad", "whitebox", "cliplesson", "antidistill"])
def test_cli_help_lists_every_field_with_default_and_help(module, capsys):
    job = importlib.import_module(f"opdkit.jobs.{module}")
    with pytest.raises(SystemExit) as exit_:
        job.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for f in fields(CONFIGS[module]):
        line = next((ln for ln in out.splitlines() if ln.split()[:1] == [f.name]), None)
        assert line is not None, f"{f.name} missing from --help"
        assert repr(f.default) in line and f.metadata["help"][:30] in line, line


def test_an_old_setting_name_is_refused_naming_the_new_one(tmp_path, capsys):
    """A renamed setting (`config.RENAMED`) in a preset, in `--set` or in a notebook's parameters stops with
    one line naming its new name(s), only those the job has."""
    (tmp_path / "whitebox").mkdir()
    (tmp_path / "whitebox" / "old.yaml").write_text("eval_steps: 5\n")
    with pytest.raises(
        ConfigError, match=r"'eval_steps' in preset .*old.yaml was renamed: use eval_every \("
    ):
        load_config(WhiteboxConfig, "old", params_dir=tmp_path)
    from opdkit.jobs import whitebox

    with pytest.raises(SystemExit) as stop:
        whitebox.main(["--mode", "tiny", "--set", "max_new_tokens=8"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: parameter 'max_new_tokens' was renamed: use rollout_max_new_tokens")
    assert "trace_max_new_tokens" not in err  # whitebox writes no traces
    from opdkit.jobs.antidistill.config import AntidistillConfig

    with pytest.raises(ConfigError, match=r"use rollout_max_new_tokens \(.*\) or trace_max_new_tokens \("):
        load_config(AntidistillConfig, "tiny", {"max_new_tokens": 8})
    with pytest.raises(
        ConfigError, match=r"'gen_batch_size' in the notebook's parameters .* trace_batch_size"
    ):
        notebook_parameters(SaveGradConfig, {"mode": "tiny", "gen_batch_size": 8})


def test_renamed_names_are_no_field_and_their_new_names_are():
    """The table of renamed settings stays true: no job declares an old name again, and each new name is a
    setting of some job."""
    names = {f.name for cls in CONFIGS.values() for f in fields(cls)}
    assert not names & set(config.RENAMED)
    assert {new for renames in config.RENAMED.values() for new, _ in renames} <= names
