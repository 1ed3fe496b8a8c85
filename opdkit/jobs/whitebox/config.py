"""whitebox's settings: `WhiteboxConfig`, the original's DistillConfig fields, composed from the settings
groups (each declared once, in `opdkit.settings`) and whitebox's own few."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from opdkit.config import ConfigError, RepeatSettings, RunFields, setting
from opdkit.settings import (
    CheckpointingSettings,
    EvalSettings,
    OPDSettings,
    OPDTraining,
    PrecisionSettings,
    PromptSettings,
    ServedSettings,
    StudentSettings,
    TeacherSetSettings,
    TeacherSettings,
)


@dataclass
class WhiteboxConfig(
    RunFields,
    RepeatSettings,
    StudentSettings,
    TeacherSettings,
    ServedSettings,
    TeacherSetSettings,
    PromptSettings,
    EvalSettings,
    PrecisionSettings,
    CheckpointingSettings,
    OPDSettings,
    OPDTraining,
):
    """White-box on-policy distillation (notebook 02); field names follow the original DistillConfig. The
    distillation's own settings (beta, temperatures, rollout engine, ...) come from `OPDSettings`, declared
    once for this config, 04's and the trainer's `OPDArguments`; the training's from `OPDTraining`."""

    job: ClassVar[str] = "whitebox"

    exclude_run: str = setting(
        "",
        "a savegrad run whose holdout prompts are left out of training (subset_size -1 would take them); "
        "empty: not checked, which the summary says",
    )
    eval_every: int = setting(
        0, "also measure greedy accuracy every this many optimizer steps while training; 0 never", min=0
    )
    eval_every_size: int = setting(
        100, "held-out problems measured every eval_every: the first of the eval_size set", min=1
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_size < 0:
            raise ConfigError(
                f"eval_size={self.eval_size} (all of the evaluation set): whitebox cuts its held-out "
                "problems from its training data, which has no evaluation set of its own; give their number, "
                "or 0 for none."
            )
