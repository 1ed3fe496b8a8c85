"""Multi-turn rollouts over processes: 02 on the tiny tool world (`environment: calculator`) run by 2 gloo
processes samples the same episodes, tool turns included, as 1 process does, and takes the same first update;
that update is TRL's loss on full logits over the student's turns of the transcripts.

The student is `tiny:teacher-tools` (it calls the calculator, so the episodes go through tool turns; the
shipped `tiny:student` never calls it) and the teacher `tiny:teacher`, both of the tiny tokenizer."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import FIXED, TOOL_RUN, assert_grads_close, direct_gradient, episodes, run_tiny, tool_turns
from safetensors.torch import load_file

from opdkit import tiny
from opdkit.opd.callbacks import GradientDump


@pytest.mark.slow
def test_one_and_two_gloo_processes_play_the_same_episodes_and_take_the_same_first_update(tmp_path):
    """global_batch_size 4 in micro-batches of 2: 2 accumulated on one process, 1 on each of two. At
    temperature 1 each episode is keyed by its row's place in the step's global batch and its turn, so both
    play the same transcripts, tool turns included; the weights after one SGD step (lr 1: the update is the
    gradient) are the same, and the gradient is TRL's loss on the student's turns."""
    common = {
        **FIXED,
        **TOOL_RUN,
        "per_device_train_batch_size": 2,
        "global_batch_size": 4,
        "rollout_temperature": 1.0,
        "optim": "sgd",
        "learning_rate": 1.0,
    }
    script = textwrap.dedent(f"""
        import torch; torch.set_num_threads(1)
        from opdkit.jobs import whitebox
        from opdkit.opd.callbacks import GradientDump
        over = {common!r}
        whitebox.run("tiny", {{**over, "run_dir": {str(tmp_path / "two")!r}, "num_processes": 2}},
                     callbacks=[GradientDump({str(tmp_path / "two.pt")!r})])
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    one_run = run_tiny(tmp_path, "one", [GradientDump(str(tmp_path / "one.pt"))], **common)
    one, two = episodes(one_run.path), episodes(tmp_path / "two")
    assert len(list((tmp_path / "two" / "rollouts").glob("*.pt"))) == 2
    assert len(one) == 4 and sorted(one) == sorted(two)
    assert all(tool_turns(m) >= 1 for _, m in one), "every episode calls the calculator"
    grads_two, grads_one = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert_grads_close(grads_two, direct_gradient(tmp_path / "two", student="tiny:teacher-tools"))
    assert_grads_close(grads_two, grads_one, rtol=1e-4)
    start = load_file(f"{tiny.resolve('tiny:teacher-tools')}/model.safetensors")
    ends = [load_file(f"{path}/model/model.safetensors") for path in (one_run.path, tmp_path / "two")]
    update_one, update_two = ({n: end[n] - w for n, w in start.items()} for end in ends)
    assert any(u.abs().max() > 0 for u in update_one.values())
    assert_grads_close(update_two, update_one, rtol=1e-4)
