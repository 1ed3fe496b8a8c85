"""antidistill's settings: one source of truth for every parameter of the antidistillation trade-off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from opdkit.ads import direction
from opdkit.config import ConfigError, RunFields, float_list, name_list, setting

ATTACKER_NAMES = ("sft", "opd", "opd-plain")  # described in attackers.py


@dataclass
class AntidistillConfig(RunFields):
    """Antidistillation sampling and its trade-off (antidistill): a λ sweep of ADS beside a temperature
    sweep; at every point the teacher writes traces and a fresh student is distilled on them by SFT."""

    job: ClassVar[str] = "antidistill"

    teacher_model: str = setting(
        "tiny:teacher", "teacher that writes the training traces: folder, hub name, or tiny:teacher"
    )
    proxy_model: str = setting(
        "tiny:student", "proxy student the gradient belongs to (shares the teacher's tokenizer)"
    )
    student_model: str = setting(
        "tiny:student",
        "student distilled at every point, afresh each time: folder, hub name, or tiny:student",
    )
    student_tokenizer: str = setting(
        "", "the student's tokenizer (and chat template) if not its own folder's, e.g. an -Instruct sibling"
    )
    student_init: str = setting(
        "pretrained",
        "pretrained: the student's weights; scratch: its architecture, freshly initialised by seed",
        choices=("pretrained", "scratch"),
    )
    grads_run: str = setting(
        "", "a savegrad run directory with grads.safetensors; empty runs savegrad inside this run"
    )
    grads_mode: str = setting(
        "tiny", "savegrad preset run when grads_run is empty (with this teacher, proxy and seed)"
    )
    dataset_path: str = setting(
        "tiny",
        "training prompts: tiny, a parquet/jsonl/json/arrow file, a saved datasets folder, or a hub name",
    )
    dataset_split: str = setting("train", "split to read from a datasets folder or hub dataset")
    subset_size: int = setting(
        512,
        "training prompts the teacher answers at every point (the head of the seed-shuffled dataset)",
        min=1,
    )
    system_prompt: str = setting("", "system message put before every prompt; empty for none")
    eval_dataset_path: str = setting(
        "", "evaluation prompts for the distilled students; empty: the tiny held-out problems"
    )
    eval_dataset_split: str = setting("test", "split of eval_dataset_path")
    eval_size: int = setting(
        300,
        "evaluation problems per distilled student (at least 1); -1 means all of eval_dataset_path",
        min=-1,
    )
    max_prompt_length: int = setting(512, "longer prompts are dropped (and counted)", min=1)
    max_new_tokens: int = setting(40, "trace length budget: tokens the teacher writes at most", min=1)
    eval_max_new_tokens: int = setting(
        0, "completion budget of the students' greedy evaluation; 0 means max_new_tokens", min=0
    )
    enable_thinking: bool = setting(False, "passed to the chat templates (Qwen3 thinking mode)")
    lams: list = setting(
        (0.0, 0.05, 0.08, 0.11), "ADS sweep: the λ values, each at every ads_temperatures value"
    )
    answer_lams: list = setting(
        (0.015, 0.03, 0.045),
        "a second ADS sweep whose gradient is the proxy's NLL on the answer tokens only (tiny: after ';', "
        "else from the last \\boxed), computed here from the gradient run's traces; empty skips it",
    )
    ads_temperatures: list = setting((1.0,), "temperatures the ADS sweeps run at")
    temperatures: list = setting(
        (1.0, 1.2, 1.4, 1.6), "baseline sweep: plain temperature sampling (λ 0) at these temperatures"
    )
    top_k: int = setting(
        0,
        "keep the k most likely tokens after the ADS term and the temperature, before top-p; 0 is off "
        "(the ADS reference: 50, transformers' default)",
        min=0,
    )
    top_p: float = setting(
        1.0,
        "nucleus applied after the ADS term, the temperature and top-k, at every point",
        min=1e-3,
        max=1.0,
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
        choices=direction.METHODS,
    )
    gen_batch_size: int = setting(
        256,
        "prompts per generation batch (and per greedy evaluation batch of the students); 0 means the largest "
        "that fits the memory plan",
        min=0,
    )
    sft_seed: int = setting(
        -1,
        "seed of the students' SFT order (and scratch initialisation); -1 means seed. The ADS "
        "reference distils with seed 69",
        min=-1,
    )
    repeats: int = setting(
        1,
        "runs of every point, with seeds seed, seed+1, ...: new sampling noise and SFT order; the mean "
        "is plotted",
        min=1,
    )
    sft_max_steps: int = setting(200, "optimizer steps of every student's SFT; -1 means sft_epochs", min=-1)
    sft_epochs: float = setting(3.0, "passes over the traces when sft_max_steps is -1", min=0.0)
    sft_batch_size: int = setting(64, "traces per optimizer step", min=1)
    sft_micro_batch_size: int = setting(
        0, "traces per forward pass (gradient accumulation); 0 means sft_batch_size", min=0
    )
    sft_learning_rate: float = setting(
        3e-3, "peak learning rate of the students' SFT (AdamW, warmup then cosine)", min=0.0
    )
    sft_weight_decay: float = setting(0.0, "AdamW weight decay of the students' SFT", min=0.0)
    sft_warmup_ratio: float = setting(0.05, "fraction of SFT steps spent warming up", min=0.0, max=0.999)
    sft_max_length: int = setting(
        0, "traces longer than this many student tokens are cut; 0 means no cap", min=0
    )
    bf16: bool = setting(
        False, "bf16 teacher and bf16 autocast for the students (GPU); the proxies always run in fp32"
    )
    gradient_checkpointing: bool = setting(
        False, "recompute the student's activations in backward to save memory"
    )
    student_lora_r: int = setting(
        0,
        "LoRA rank of the distilled students (peft: pip install 'opdkit[lora]'); 0 fine-tunes every weight",
        min=0,
    )
    student_lora_alpha: float = setting(
        0.0, "LoRA alpha (the adapter's scale is alpha / r); 0 means student_lora_r", min=0.0
    )
    student_lora_dropout: float = setting(0.0, "dropout on the LoRA adapters' inputs", min=0.0, max=1.0)
    student_lora_target_modules: list = setting(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "modules of the student that get a LoRA adapter (names, or [all-linear])",
    )
    student_save: str = setting(
        "adapter",
        "what of each distilled student is kept in points/<name>/seed<seed>/student/: adapter (the LoRA "
        "adapter; without LoRA the whole model), merged (the model with the adapter merged in), none",
        choices=("adapter", "merged", "none"),
    )
    sft_save_steps: int = setting(
        0, "checkpoint each student every this many SFT steps (resume continues from it); 0 never", min=0
    )

    attackers: list = setting(
        ("sft",),
        "students distilled at every point: sft (on the teacher's traces), opd (on-policy, the teacher "
        "scoring with the ADS distribution at the point's λ and τ), opd-plain (on-policy, the plain teacher "
        "at τ); sft is always among them",
    )
    opd_max_steps: int = setting(60, "optimizer steps of every on-policy attacker (opd, opd-plain)", min=1)
    opd_batch_size: int = setting(32, "prompts per step of the on-policy attackers", min=1)
    opd_learning_rate: float = setting(
        1e-3, "constant learning rate of the on-policy attackers (AdamW, reverse KL, clipped at 1)", min=0.0
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("lams", "answer_lams", "ads_temperatures", "temperatures"):
            setattr(self, name, float_list(name, getattr(self, name)))
        if self.eval_size == 0:
            raise ConfigError(
                "eval_size=0 leaves every distilled student unmeasured, and the trade-off is their accuracy; "
                "give a positive number of evaluation problems, or -1 for all of eval_dataset_path."
            )
        if not (self.lams or self.answer_lams or self.temperatures):
            raise ConfigError(
                "lams, answer_lams and temperatures are all empty; give at least one sweep point."
            )
        if (self.lams or self.answer_lams) and not self.ads_temperatures:
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
        unknown = [a for a in self.attackers if a not in ATTACKER_NAMES]
        if unknown or "sft" not in self.attackers:
            raise ConfigError(
                f"attackers={self.attackers}: each is one of {list(ATTACKER_NAMES)}, and sft is among them "
                "(every point distils its SFT student)."
            )
        on_policy = [a for a in self.attackers if a != "sft"]
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
        self.student_lora_target_modules = name_list(
            "student_lora_target_modules", self.student_lora_target_modules
        )
