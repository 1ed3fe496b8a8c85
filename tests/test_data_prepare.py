"""`python -m opdkit.data.prepare` on a local copy laid out like the Hub (the Hub itself is not reachable
here): DAPO-Math-17k deduplicated by prompt, the GSM8K files as they are, failures reported, nothing
overwritten; and the Hub call asks for the ids, configs and splits the presets name."""

from __future__ import annotations

import datasets
import pytest

from opdkit import tasks
from opdkit.config import load_config
from opdkit.data import prepare
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.whitebox.config import WhiteboxConfig


@pytest.fixture
def local_hub(tmp_path, dapo_parquet):
    """DAPO rows repeated 3 times in a shuffled order (as the original repeats each prompt), GSM8K train/test;
    no GSM8K-Platinum."""
    root = tmp_path / "hub"
    dapo = datasets.Dataset.from_parquet(str(dapo_parquet))
    order = [i for rep in range(3) for i in (range(len(dapo)) if rep != 1 else reversed(range(len(dapo))))]
    (root / "BytedTsinghua-SIA/DAPO-Math-17k/default").mkdir(parents=True)
    dapo.select(order).to_parquet(str(root / "BytedTsinghua-SIA/DAPO-Math-17k/default/train.parquet"))
    gsm = root / "openai/gsm8k/main"
    gsm.mkdir(parents=True)
    for split, n in (("train", 7), ("test", 3)):
        datasets.Dataset.from_dict(
            {
                "question": [f"{split} question {i}: what is {i} + {i}?" for i in range(n)],
                "answer": [f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}" for i in range(n)],
            }
        ).to_parquet(str(gsm / f"{split}.parquet"))
    return root, dapo


def test_files_from_a_local_hub(tmp_path, local_hub, capsys):
    root, dapo = local_hub
    out = tmp_path / "data"
    assert prepare.main(["--out", str(out), "--local-hub", str(root)]) == 1  # platinum is missing
    said = capsys.readouterr().out
    assert (
        "gsm8k-platinum-test.parquet: FAILED" in said
        and "eval_dataset_path data/gsm8k-main-test.parquet" in said
    )
    unique = datasets.Dataset.from_parquet(str(out / "dapo-math-17k-unique.parquet"))
    assert unique.column_names == dapo.column_names
    assert unique.to_list() == dapo.to_list()  # one row per prompt, first occurrences, in order
    assert "12 unique prompts of 36 rows" in said
    path = str(out / "gsm8k-main-train.parquet")
    train = tasks.for_dataset(path).load_prompts(path)  # GSM8K's task reads the answer after ####
    assert len(train) == 7 and sorted(train["answer"]) == sorted(str(2 * i) for i in range(7))
    assert len(datasets.Dataset.from_parquet(str(out / "gsm8k-main-test.parquet"))) == 3
    assert not (out / "gsm8k-platinum-test.parquet").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_existing_files_are_kept_unless_overwrite(tmp_path, local_hub):
    root, _ = local_hub
    out = tmp_path / "data"
    out.mkdir()
    (out / "gsm8k-main-test.parquet").write_text("mine")
    report = prepare.prepare(out, ["gsm8k-main-test.parquet"], root)
    assert (
        report["gsm8k-main-test.parquet"].startswith("kept")
        and (out / "gsm8k-main-test.parquet").read_text() == "mine"
    )
    prepare.prepare(out, ["gsm8k-main-test.parquet"], root, overwrite=True)
    assert len(datasets.Dataset.from_parquet(str(out / "gsm8k-main-test.parquet"))) == 3
    with pytest.raises(ValueError, match="unknown data files"):
        prepare.prepare(out, ["gsm8k.parquet"])


def test_hub_requests_and_preset_paths(monkeypatch, tmp_path):
    calls = []

    def fake(repo, config, split):
        calls.append((repo, config, split))
        return datasets.Dataset.from_dict({"question": ["q"], "answer": ["#### 1"]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    prepare.prepare(tmp_path, ["gsm8k-main-train.parquet", "gsm8k-platinum-test.parquet"])
    assert calls == [("openai/gsm8k", "main", "train"), ("madrylab/gsm8k-platinum", "main", "test")]
    named = {
        load_config(AntidistillConfig, "ads-paper").eval_dataset_path,
        load_config(AntidistillConfig, "ads-paper").dataset_path,
        load_config(SaveGradConfig, "ads-paper").dataset_path,
        load_config(WhiteboxConfig, "full").dataset_path,
    }
    assert {p.removeprefix("data/") for p in named} <= set(prepare.FILES)
