"""whitebox's settings: `WhiteboxConfig`, the original's DistillConfig fields, composed from the settings
groups (each declared once, beside the code that reads it) and whitebox's own few."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from opdkit.config import ConfigError, RepeatSettings, RunFields, setting
from opdkit.data.prompts import PromptSettings
from opdkit.models import CheckpointingSettings, PrecisionSettings, StudentSettings, TeacherSettings
from opdkit.opd.arguments import OPDSettings, OPDTraining
from opdkit.opd.mixture import TeacherSetSettings
from opdkit.opd.served import ServedSettings
from opdkit.tasks.evaluate import EvalSettings


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
    eval_steps: int = setting(
        0, "also measure greedy accuracy every this many optimizer steps while training; 0 never", min=0
    )
    eval_steps_size: int = setting(
        100, "held-out problems measured every eval_steps: the first of the eval_size set", min=1
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_size < 0:
            raise ConfigError(
                f"eval_size={self.eval_size}: whitebox evaluates on held-out problems cut from its data; "
                "give "
                "their number, or 0 to skip evaluation."
            )
