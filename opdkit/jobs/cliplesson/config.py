"""cliplesson's settings: `ClipLessonConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from opdkit.config import RepeatSettings, RunFields, setting
from opdkit.settings import ServedSettings


@dataclass
class ClipLessonConfig(RunFields, RepeatSettings, ServedSettings):
    """Clip versus no-clip (notebook 03): arms built from whitebox presets or runs; with `teacher_server`,
    every arm's teacher is that server's."""

    job: ClassVar[str] = "cliplesson"

    clip_mode: str = setting("tiny", "whitebox preset of the clipped arm (the original: sanity)")
    noclip_mode: str = setting("tiny-noclip", "whitebox preset of the unclipped arm (the original: noclip)")
    clip_run: str = setting("", "an existing whitebox run directory to use as the clipped arm")
    noclip_run: str = setting("", "an existing whitebox run directory to use as the unclipped arm")
    ablations: bool = setting(
        True, "also run clip at the noclip learning rate and noclip at the clip learning rate"
    )
    sgd_arms: bool = setting(
        False, "also run clip and noclip with SGD and momentum, an optimizer that does not bound its own step"
    )
    sgd_lr: float = setting(0.05, "learning rate of both SGD arms", min=0.0)
    sgd_momentum: float = setting(0.9, "momentum of both SGD arms", min=0.0, max=1.0)
    arm_max_steps: int = setting(0, "optimizer steps of every arm; 0 keeps each arm preset's", min=0)
    arm_eval_size: int = setting(
        -1, "held-out problems per accuracy measurement of every arm; -1 keeps each arm preset's", min=-1
    )
