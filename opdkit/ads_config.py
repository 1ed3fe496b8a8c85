"""04_antidistill's settings: one source of truth for every parameter of the antidistillation trade-off."""

from __future__ import annotations

from dataclasses import dataclass

from opdkit.fields import ConfigError, RunFields, _f, _float_list, _name_list


@dataclass
class AntidistillationConfig(RunFields):
    """Antidistillation sampling and its trade-off (04_antidistill): a λ sweep of ADS beside a temperature
    sweep; at every point the teacher writes traces and a fresh student is distilled on them by SFT."""

    teacher_model: str = _f(
        "tiny:teacher", "teacher that writes the training traces: folder, hub name, or tiny:teacher"
    )
    proxy_model: str = _f(
        "tiny:student", "proxy student the gradient belongs to (shares the teacher's tokenizer)"
    )
    student_model: str = _f(
        "tiny:student",
        "student distilled at every point, afresh each time: folder, hub name, or tiny:student",
    )
    student_tokenizer: str = _f(
        "", "the student's tokenizer (and chat template) if not its own folder's, e.g. an -Instruct sibling"
    )
    student_init: str = _f(
        "pretrained",
        "pretrained: the student's weights; scratch: its architecture, freshly initialised by seed",
        choices=("pretrained", "scratch"),
    )
    grads_run: str = _f(
        "", "a 01_save_grad run directory with grads.safetensors; empty runs 01_save_grad inside this run"
    )
    grads_mode: str = _f(
        "tiny", "01_save_grad preset run when grads_run is empty (with this teacher, proxy and seed)"
    )
    dataset_path: str = _f(
        "tiny",
        "training prompts: tiny, a parquet/jsonl/json/arrow file, a saved datasets folder, or a hub name",
    )
    dataset_split: str = _f("train", "split to read from a datasets folder or hub dataset")
    subset_size: int = _f(
        512,
        "training prompts the teacher answers at every point (the head of the seed-shuffled dataset)",
        min=1,
    )
    system_prompt: str = _f("", "system message put before every prompt; empty for none")
    eval_dataset_path: str = _f(
        "", "evaluation prompts for the distilled students; empty: the tiny held-out problems"
    )
    eval_dataset_split: str = _f("test", "split of eval_dataset_path")
    eval_size: int = _f(
        300,
        "evaluation problems per distilled student (at least 1); -1 means all of eval_dataset_path",
        min=-1,
    )
    max_prompt_length: int = _f(512, "longer prompts are dropped (and counted)", min=1)
    max_new_tokens: int = _f(40, "trace length budget: tokens the teacher writes at most", min=1)
    eval_max_new_tokens: int = _f(
        0, "completion budget of the students' greedy evaluation; 0 means max_new_tokens", min=0
    )
    enable_thinking: bool = _f(False, "passed to the chat templates (Qwen3 thinking mode)")
    lams: list = _f((0.0, 0.05, 0.08, 0.11), "ADS sweep: the λ values, each at every ads_temperatures value")
    answer_lams: list = _f(
        (0.015, 0.03, 0.045),
        "a second ADS sweep whose gradient is the proxy's NLL on the answer tokens only (tiny: after ';', "
        "else from the last \\boxed), computed here from the gradient run's traces; empty skips it",
    )
    ads_temperatures: list = _f((1.0,), "temperatures the ADS sweeps run at")
    temperatures: list = _f(
        (1.0, 1.2, 1.4, 1.6), "baseline sweep: plain temperature sampling (λ 0) at these temperatures"
    )
    top_k: int = _f(
        0,
        "keep the k most likely tokens after the ADS term and the temperature, before top-p; 0 is off "
        "(the ADS reference: 50, transformers' default)",
        min=0,
    )
    top_p: float = _f(
        1.0,
        "nucleus applied after the ADS term, the temperature and top-k, at every point",
        min=1e-3,
        max=1.0,
    )
    grad_scale: float = _f(
        1.0,
        "multiplies the loaded gradient g before ADS uses it; 0.125 reproduces the ADS reference, whose "
        "saved gradient is 1/8 of the mean (DDP already averages over its 8 processes and the reference "
        "divides again)",
        min=0.0,
    )
    eps: float = _f(1e-2, "finite-difference step along the gradient: proxies at θ+εg and θ−εg", min=1e-12)
    ads_method: str = _f(
        "fd",
        "fd: finite difference with two KV-cached proxies; jvp: exact torch.func.jvp, no cache "
        "(small models)",
        choices=("fd", "jvp"),
    )
    gen_batch_size: int = _f(256, "prompts per generation batch", min=1)
    sft_seed: int = _f(
        -1,
        "seed of the students' SFT order (and scratch initialisation); -1 means seed. The ADS "
        "reference distils with seed 69",
        min=-1,
    )
    repeats: int = _f(
        1,
        "runs of every point, with seeds seed, seed+1, ...: new sampling noise and SFT order; the mean "
        "is plotted",
        min=1,
    )
    sft_max_steps: int = _f(200, "optimizer steps of every student's SFT; -1 means sft_epochs", min=-1)
    sft_epochs: float = _f(3.0, "passes over the traces when sft_max_steps is -1", min=0.0)
    sft_batch_size: int = _f(64, "traces per optimizer step", min=1)
    sft_micro_batch_size: int = _f(
        0, "traces per forward pass (gradient accumulation); 0 means sft_batch_size", min=0
    )
    sft_learning_rate: float = _f(
        3e-3, "peak learning rate of the students' SFT (AdamW, warmup then cosine)", min=0.0
    )
    sft_weight_decay: float = _f(0.0, "AdamW weight decay of the students' SFT", min=0.0)
    sft_warmup_ratio: float = _f(0.05, "fraction of SFT steps spent warming up", min=0.0, max=0.999)
    sft_max_length: int = _f(0, "traces longer than this many student tokens are cut; 0 means no cap", min=0)
    bf16: bool = _f(
        False, "bf16 teacher and bf16 autocast for the students (GPU); the proxies always run in fp32"
    )
    gradient_checkpointing: bool = _f(False, "recompute the student's activations in backward to save memory")
    student_lora_r: int = _f(
        0,
        "LoRA rank of the distilled students (peft: pip install 'opdkit[lora]'); 0 fine-tunes every weight",
        min=0,
    )
    student_lora_alpha: float = _f(
        0.0, "LoRA alpha (the adapter's scale is alpha / r); 0 means student_lora_r", min=0.0
    )
    student_lora_dropout: float = _f(0.0, "dropout on the LoRA adapters' inputs", min=0.0, max=1.0)
    student_lora_target_modules: list = _f(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "modules of the student that get a LoRA adapter (names, or [all-linear])",
    )
    student_save: str = _f(
        "adapter",
        "what of each distilled student is kept in points/<name>/seed<seed>/student/: adapter (the LoRA "
        "adapter; without LoRA the whole model), merged (the model with the adapter merged in), none",
        choices=("adapter", "merged", "none"),
    )
    sft_save_steps: int = _f(
        0, "checkpoint each student every this many SFT steps (resume continues from it); 0 never", min=0
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("lams", "answer_lams", "ads_temperatures", "temperatures"):
            setattr(self, name, _float_list(name, getattr(self, name)))
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
        self.student_lora_target_modules = _name_list(
            "student_lora_target_modules", self.student_lora_target_modules
        )
