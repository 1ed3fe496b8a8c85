"""antidistill's settings: `AntidistillConfig`, composed from the settings groups (each declared once, in
`opdkit.settings`: the students' `SFTSettings`, the on-policy attackers' `OPDSettings` and `OPDTraining`,
...) and the sweep's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from opdkit.config import ConfigError, RepeatSettings, RunFields, float_list, name_list, setting
from opdkit.settings import (
    ADS_METHODS,
    CheckpointingSettings,
    EvalSettings,
    GradientTokenSettings,
    OPDSettings,
    OPDTraining,
    PrecisionSettings,
    PromptSettings,
    ProxySettings,
    ServedSettings,
    SFTSettings,
    StudentSettings,
    TeacherSettings,
    TraceSettings,
    parse_defence,
)

ATTACKER_NAMES = ("sft", "opd", "opd-plain")  # described in points.py


@dataclass
class AntidistillConfig(
    RunFields,
    RepeatSettings,
    TeacherSettings,
    ProxySettings,
    StudentSettings,
    PromptSettings,
    EvalSettings,
    PrecisionSettings,
    CheckpointingSettings,
    TraceSettings,
    SFTSettings,
    OPDSettings,
    OPDTraining,
    ServedSettings,
    GradientTokenSettings,
):
    """Antidistillation sampling and its trade-off (antidistill): a λ sweep of ADS beside a temperature
    sweep; at every point the teacher writes traces and a fresh student is distilled on them by SFT
    (`SFTSettings`), and, when `attackers` asks, on-policy students by 02's recipe (`OPDSettings`,
    `OPDTraining`: its learning_rate, max_steps, per_device_train_batch_size, ...)."""

    job: ClassVar[str] = "antidistill"

    student_tokenizer: str = setting(
        "", "the student's tokenizer (and chat template) if not its own folder's, e.g. an -Instruct sibling"
    )
    grads_run: str = setting(
        "", "a savegrad run directory with grads.safetensors; empty runs savegrad inside this run"
    )
    grads_mode: str = setting(
        "tiny",
        "savegrad preset run when grads_run is empty, with this run's teacher, proxy and prompts "
        "(dataset_path, split, seed, prompt length, system prompt): its holdout is this file's tail",
    )
    eval_dataset_path: str = setting(
        "", "evaluation prompts for the distilled students; empty: the task's own held-out problems"
    )
    eval_dataset_split: str = setting("test", "split of eval_dataset_path")
    lams: list = setting(
        (0.0, 0.05, 0.08, 0.11), "ADS sweep: the λ values, each at every ads_temperatures value"
    )
    answer_lams: list = setting(
        (0.015, 0.03, 0.045),
        "a second ADS sweep whose gradient is the proxy's NLL on the answer tokens only (tiny: after ';', "
        "else from the last \\boxed), computed here from the gradient run's traces; empty skips it",
    )
    confident_lams: list = setting(
        (),
        "a third ADS sweep whose gradient is the proxy's on every completion token but those the teacher "
        "hesitates on (entropy above grad_entropy; answer tokens kept), computed here from the gradient "
        "run's traces; empty skips it",
    )
    ads_temperatures: list = setting((1.0,), "temperatures the ADS sweeps run at")
    temperatures: list = setting(
        (1.0, 1.2, 1.4, 1.6), "baseline sweep: plain temperature sampling (λ 0) at these temperatures"
    )
    trace_top_k: int = setting(
        0,
        "keep the k most likely tokens after the ADS term and the temperature, before top-p; 0 is off "
        "(the ADS reference: 50, transformers' default)",
        min=0,
    )
    grad_scale: float = setting(
        1.0,
        "multiplies the loaded gradient g before ADS uses it; 0.125 reproduces the ADS reference, whose "
        "saved gradient is 1/8 of the mean (DDP already averages over its 8 processes and the reference "
        "divides again)",
        min=0.0,
    )
    eps: float = setting(
        1e-2, "finite-difference step along the gradient: proxies at θ+εg and θ−εg", min=1e-12
    )
    ads_method: str = setting(
        "fd",
        "fd: finite difference with two KV-cached proxies; jvp: exact torch.func.jvp, no cache "
        "(small models)",
        choices=ADS_METHODS,
    )
    attackers: list = setting(
        ("sft",),
        "students distilled at every point: sft (on the teacher's traces), opd (on-policy, the teacher "
        "scoring with the ADS distribution at the point's λ and τ), opd-plain (on-policy, the plain teacher "
        "at τ); sft is always among them",
    )
    defences: list = setting(
        (),
        "defended attackers: each a teacher_defence (topk:K, sampled, round:D, noise:S; see 02's "
        "teacher_defence) run as an on-policy attacker of the plain teacher at τ 1 (λ 0), at the "
        "temperature-lam0-tau1 point, against its control opd-plain of the same seed; with each one's cost "
        "to honest users of the scores; empty: none",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("lams", "answer_lams", "confident_lams", "ads_temperatures", "temperatures"):
            setattr(self, name, float_list(name, getattr(self, name)))
        if self.eval_size == 0:
            raise ConfigError(
                "eval_size=0 (none) leaves every distilled student unmeasured, and the trade-off is their "
                "accuracy; give a positive number of evaluation problems, or -1 for all of eval_dataset_path."
            )
        if not (self.lams or self.answer_lams or self.confident_lams or self.temperatures):
            raise ConfigError(
                "lams, answer_lams, confident_lams and temperatures are all empty; give at least one sweep "
                "point."
            )
        if self.confident_lams and self.grad_tokens != "all":
            raise ConfigError(
                f"confident_lams sweeps the gradient without the teacher's hesitations beside lams' whole "
                f"completion gradient, but grad_tokens={self.grad_tokens} already makes lams' gradient a "
                "variant; leave grad_tokens all, or confident_lams empty."
            )
        if (self.lams or self.answer_lams or self.confident_lams) and not self.ads_temperatures:
            raise ConfigError(
                "an ADS sweep is set but ads_temperatures is empty; give the temperature ADS samples at, "
                "e.g. [1.0]."
            )
        negative = [(n, v) for n in ("ads_temperatures", "temperatures") for v in getattr(self, n) if v < 0]
        if negative:
            raise ConfigError(
                f"{negative[0][0]} holds {negative[0][1]}; temperatures are >= 0 (0 is greedy)."
            )
        self.attackers = name_list("attackers", self.attackers)
        if self.teacher_server == "local":
            raise ConfigError(
                "teacher_server local starts a server around one distillation run (02), and antidistill's "
                "attackers are many short runs inside one sweep process; give the URL of a running pooling "
                "server instead."
            )
        if self.teacher_server:  # read by the on-policy attackers' trainers only
            if not [a for a in self.attackers if a != "sft"]:
                raise ConfigError(
                    "teacher_server is read by the on-policy attackers (opd, opd-plain) only, and attackers "
                    "has none; add one, or leave teacher_server empty."
                )
            if self.teacher_logprobs != "exact" or self.teacher_server_reference:
                raise ConfigError(
                    "antidistill's attackers take teacher_server as the URL of a running pooling server, "
                    "with teacher_logprobs exact and no teacher_server_reference (the sweep holds the "
                    "teacher for its traces anyway)."
                )
        unknown = [a for a in self.attackers if a not in ATTACKER_NAMES]
        if unknown or "sft" not in self.attackers:
            raise ConfigError(
                f"attackers={self.attackers}: each is one of {list(ATTACKER_NAMES)}, and sft is among them "
                "(every point distils its SFT student)."
            )
        on_policy = [a for a in self.attackers if a != "sft"]
        if self.rollout_engine != "hf":
            raise ConfigError(
                f"rollout_engine={self.rollout_engine!r}: antidistill's on-policy attackers sample with the "
                "kit's "
                "loop beside the ADS teacher; leave rollout_engine hf."
            )
        if on_policy and self.ads_method != "fd":
            raise ConfigError(
                f"attackers {on_policy} score with the ADS teacher, which stacks the finite difference's two "
                "proxies; set ads_method fd."
            )
        if on_policy and 0.0 in [*self.ads_temperatures, *self.temperatures]:
            raise ConfigError(
                f"attackers {on_policy} read the teacher's log-probabilities at the point's temperature, and "
                "temperature 0 (greedy) has none; leave 0 out of the temperatures."
            )
        self.check_defences()

    def check_defences(self) -> None:
        """`defences` parse, and have what they are measured against: opd-plain, the τ 1 control point,
        kl_temperature 1 (and beta 1 for sampled)."""
        self.defences = [] if not self.defences else name_list("defences", self.defences)
        for spec in self.defences:
            try:
                kind, _ = parse_defence(spec)
            except ValueError as e:
                raise ConfigError(f"defences: {e}") from None
            if kind == "none":
                raise ConfigError(
                    "defences holds none, the undefended teacher: that is the control (opd-plain); leave it "
                    "out."
                )
            if kind == "sampled" and self.beta != 1.0:
                raise ConfigError(
                    f"defences holds sampled at beta={self.beta:g}: its per-token log-ratio loss estimates "
                    "reverse KL only; set beta 1, or leave sampled out."
                )
        if not self.defences:
            return
        control = 1.0 in self.temperatures or (0.0 in self.lams and 1.0 in self.ads_temperatures)
        if "opd-plain" not in self.attackers or not control:
            raise ConfigError(
                f"defences {self.defences} are measured against opd-plain at τ 1 (λ 0): add opd-plain to "
                "attackers and 1.0 to temperatures."
            )
        if self.kl_temperature != 1.0:
            raise ConfigError(
                f"defences at kl_temperature={self.kl_temperature:g}: a defended teacher serves "
                "log-probabilities at temperature 1; set kl_temperature 1."
            )
