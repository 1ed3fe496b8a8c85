"""whitebox's settings: `WhiteboxConfig`, the original's DistillConfig fields, composed from the settings
groups (each declared once, in `opdkit.settings`) and whitebox's own few."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import ClassVar

from opdkit.config import ConfigError, RepeatSettings, RunFields, setting
from opdkit.settings import (
    CheckpointingSettings,
    DefenceSettings,
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
    DefenceSettings,
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
    ahead_arms: str = setting(
        "",
        "arms run after this (synchronous) run, each a whitebox run of its own in arms/<arm>/ at the same "
        "seeds and settings: s samples s steps ahead as they are (rollout_ahead s, async_correction none), "
        "st corrects them (async_correction truncated); comma-separated, e.g. 1,1t,4,4t; empty: none",
    )

    def normalise(self) -> None:
        """`ahead_arms` as a comma-separated string without spaces (a YAML or papermill list joined)."""
        arms = self.ahead_arms
        if isinstance(arms, (list, tuple)):
            arms = ",".join(str(a) for a in arms)
        self.ahead_arms = "".join(str(arms).split())

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_ahead_arms()
        if self.eval_size < 0:
            raise ConfigError(
                f"eval_size={self.eval_size} (all of the evaluation set): whitebox cuts its held-out "
                "problems from its training data, which has no evaluation set of its own; give their number, "
                "or 0 for none."
            )

    def arms(self) -> list[AheadArm]:
        """The arms of `ahead_arms`, in the order given."""
        return parse_ahead_arms(self.ahead_arms)

    def check_ahead_arms(self) -> None:
        """`ahead_arms`: each arm parses, this run is the synchronous one, and each arm's own settings hold
        (its run's config, built here); each failure one line, before anything is written."""
        arms = self.arms()
        if not arms:
            return
        if self.rollout_ahead:
            raise ConfigError(
                f"ahead_arms={self.ahead_arms} runs its arms beside this run, the synchronous one, and "
                f"rollout_ahead is {self.rollout_ahead}: set rollout_ahead 0 (each arm sets its own)."
            )
        for arm in arms:
            if arm.correction != "none" and self.topk():
                raise ConfigError(
                    f"ahead_arms: arm {arm.name} weights the exact divergence per token, and "
                    f"teacher_logprobs {self.teacher_logprobs} is an approximation that takes no weights: "
                    "use arms without t, or teacher_logprobs exact."
                )
            try:
                dataclasses.replace(self, **arm.overrides())
            except ConfigError as e:
                raise ConfigError(f"ahead_arms: arm {arm.name}: {e}") from None


AHEAD_ARM = re.compile(r"([0-9]+)(t?)")


@dataclass(frozen=True)
class AheadArm:
    """One arm of `ahead_arms`: `name` (its folder in arms/), the steps it samples ahead, its correction."""

    name: str
    ahead: int
    correction: str

    @property
    def label(self) -> str:
        return f"s={self.ahead}" + (" corrected" if self.correction != "none" else "")

    def overrides(self) -> dict:
        """What the arm's whitebox run sets beside the parent's settings (no arms of its own)."""
        return {"rollout_ahead": self.ahead, "async_correction": self.correction, "ahead_arms": ""}


def parse_ahead_arms(text: str) -> list[AheadArm]:
    """`1,1t,4,4t` -> the arms: `s` samples s >= 1 steps ahead uncorrected, `st` with the truncated
    correction; anything else, or an arm given twice, is one ConfigError line."""
    arms: list[AheadArm] = []
    for part in (p for p in text.split(",") if p) if text else ():
        m = AHEAD_ARM.fullmatch(part)
        if m is None or int(m.group(1)) < 1:
            raise ConfigError(
                f"ahead_arms: {part!r} is no arm; each is s (steps sampled ahead, >= 1, uncorrected) or st "
                "(the same, truncated correction), comma-separated, e.g. 1,1t,4,4t."
            )
        arm = AheadArm(
            f"{int(m.group(1))}{m.group(2)}", int(m.group(1)), "truncated" if m.group(2) else "none"
        )
        if arm in arms:
            raise ConfigError(f"ahead_arms: arm {arm.name} is given twice in {text!r}.")
        arms.append(arm)
    return arms
