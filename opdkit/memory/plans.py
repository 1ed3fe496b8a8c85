"""A stage's plan against a budget (`plan` -> `Plan`), the largest batch that fits, the settings that would
make it fit, and a job's plan over its stages (`plan_job` -> `JobPlan`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opdkit.config import ConfigError
from opdkit.memory.components import ALWAYS, Component, components_of, producer_components, queue_components
from opdkit.memory.device import host_memory_gb
from opdkit.memory.shapes import GB
from opdkit.memory.stages import Stage

RESERVE_SHARE = 0.05  # of the budget, held back for what no row plans (`reserve_bytes`)
RESERVE_MIN_GB = 2.0
PLAN_FILE = "plan.json"  # a run folder's copy of its plan (JobPlan.to_json)


@dataclass(frozen=True)
class Suggestion:
    """Settings (by the job's field names) under which the plan fits, and that plan's total."""

    settings: dict[str, Any]
    total_bytes: int

    def __str__(self) -> str:
        text = " ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings.items()
        )
        return f"{text} ({self.total_bytes / GB:.1f} GB)"


@dataclass
class Plan:
    """Rows, the total (the always rows plus the largest phase), the budget, and what would fit it."""

    rows: list[Component]
    budget_bytes: float | None = None
    suggestions: list[Suggestion] = field(default_factory=list)
    where: str = "per process"  # what the total is of, as the summary says it

    def phase_totals(self) -> dict[str, int]:
        """Bytes held at each phase: the always rows plus that phase's."""
        always = sum(r.bytes for r in self.rows if r.phase == ALWAYS)
        phases = {p for r in self.rows if r.phase != ALWAYS for p in r.phases}
        totals = {p: always + sum(r.bytes for r in self.rows if p in r.phases) for p in phases}
        return totals or {ALWAYS: always}

    @property
    def peak_phase(self) -> str:
        totals = self.phase_totals()
        return max(totals, key=totals.__getitem__)

    @property
    def total(self) -> int:
        return max(self.phase_totals().values())

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.total <= self.budget_bytes

    def row(self, component: str) -> Component:
        for r in self.rows:
            if r.component == component:
                return r
        raise KeyError(f"no row {component!r} in this plan; it has {[r.component for r in self.rows]}")

    def summary(self) -> str:
        """`table()`'s last line: 'plan: <total> GB of <budget> GB per process: fits' (or 'does not fit')."""
        if self.budget_bytes is None:
            return f"plan: {self.total / GB:.1f} GB {self.where}: no budget set"
        verdict = "fits" if self.fits else "does not fit"
        return f"plan: {self.total / GB:.1f} GB of {self.budget_bytes / GB:.1f} GB {self.where}: {verdict}"

    def table(self) -> str:
        width = max(len("component"), *(len(r.component) for r in self.rows))
        held = max(len("held"), *(len(r.phase) for r in self.rows))
        lines = [f"{'component':<{width}}  {'GB':>7}  {'held':<{held}}  how computed"]
        lines += [
            f"{r.component:<{width}}  {r.bytes / GB:>7.2f}  {r.phase:<{held}}  {r.how}" for r in self.rows
        ]
        totals = sorted(self.phase_totals().items())
        lines.append("held at each phase: " + ", ".join(f"{p} {b / GB:.2f} GB" for p, b in totals))
        if not self.fits:
            if self.suggestions:
                lines.append("would fit with: " + "; ".join(map(str, self.suggestions)))
            else:
                lines.append("no setting brings it under: smaller models, more processes, or a larger GPU")
        lines.append(self.summary())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """For the run folder (JSON-safe)."""
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "phase_totals": self.phase_totals(),
            "total_bytes": self.total,
            "peak_phase": self.peak_phase,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "suggestions": [{"settings": s.settings, "total_bytes": s.total_bytes} for s in self.suggestions],
        }


def plan(stage: Stage, budget_gb: float | None = None, suggest: bool = True) -> Plan:
    """The plan of `stage` against `budget_gb` (None: no budget, nothing enforced); when it does not fit,
    `suggestions` holds settings that would bring it under, each checked by planning again."""
    budget = None if budget_gb is None else budget_gb * GB
    rows = components_of(stage, budget)
    if budget is not None:
        rows.append(_reserve_component(budget))
    p = Plan(rows, budget)
    if suggest and not p.fits:
        p.suggestions = suggestions(stage, budget_gb)
    return p


def reserve_bytes(budget_bytes: float) -> int:
    """What a plan against `budget_bytes` holds back for what no row plans: the CUDA context (0.3-0.6 GB),
    cuBLAS and cuDNN workspaces, NCCL's buffers (about 0.3-1 GB per communicator), and the caching
    allocator's fragmentation, which grows with what is allocated: `RESERVE_SHARE` of the budget, at least
    `RESERVE_MIN_GB`."""
    return int(max(RESERVE_MIN_GB * GB, RESERVE_SHARE * budget_bytes))


def _reserve_component(budget: float) -> Component:
    how = (
        f"max({RESERVE_MIN_GB:g} GB, {RESERVE_SHARE:.0%} of {budget / GB:.1f} GB): CUDA context, cuBLAS "
        "workspaces, NCCL buffers, allocator fragmentation"
    )
    return Component("reserve", reserve_bytes(budget), how)


def largest_batch(stage: Stage, budget_gb: float, field: str = "sampled_rows", limit: int = 65536) -> int:
    """The largest `field` (sampled_rows, eval_batch_size or train_batch_size, at most `limit`) whose plan
    fits `budget_gb`; 0 if not even 1 does. What `trace_batch_size: 0` means in 01 and 04."""
    if field not in ("sampled_rows", "eval_batch_size", "train_batch_size"):
        raise ValueError(
            f"field={field!r}: largest_batch sizes sampled_rows, eval_batch_size or train_batch_size."
        )
    if field == "sampled_rows" and stage.rollout_engine == "vllm":
        raise ValueError(
            "with rollout_engine=vllm the engine batches within its share: size the share instead."
        )

    def fits(n: int) -> bool:
        return plan(dataclasses.replace(stage, **{field: n}), budget_gb, suggest=False).fits

    if limit < 1 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo); hi does not fit or is past the limit
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def suggestions(stage: Stage, budget_gb: float) -> list[Suggestion]:
    """Settings that bring `stage` under `budget_gb`, each checked by planning again: every single change
    that does (a smaller trace_batch_size or eval_batch_size, vllm_gpu_memory_utilization, parallelism=fsdp,
    gradient_checkpointing), else the smallest-found combination of them; [] when nothing does. Each is
    named by the job's setting: the teacher's sampled rows are `trace_batch_size` (01, 04); a student's
    rollout rows are the step's batch, no setting of their own, so they are not suggested."""
    changes: list[dict[str, Any]] = []
    if stage.sampled_rows > 1 and stage.rollout_engine == "hf" and stage.sampler == "teacher":
        changes.append({"sampled_rows": _largest(stage, budget_gb, "sampled_rows")})
    if stage.eval_batch_size > 1:
        changes.append({"eval_batch_size": _largest(stage, budget_gb, "eval_batch_size")})
    if stage.rollout_engine == "vllm":
        changes.append(
            {"vllm_gpu_memory_utilization": _largest(stage, budget_gb, "vllm_gpu_memory_utilization")}
        )
    if stage.parallelism == "ddp" and stage.world_size > 1:
        changes.append({"parallelism": "fsdp"})
    if stage.train_batch_size and not stage.gradient_checkpointing:
        changes.append({"gradient_checkpointing": True})
    # A batch or share of 0 (none fits alone) is no suggestion by itself, but may be one with the others.
    fitting = [c for c in changes if 0 not in c.values() and _fits(stage, budget_gb, c)]
    if not fitting:
        # Everything at once (the smallest batches and share), then each setting back where the others
        # allow: dropped if they fit without it, else its largest value that fits with them.
        together = {k: v for c in changes for k, v in c.items()}
        smallest = {
            k: 1 if k.endswith("batch_size") else 0.05 if k.startswith("vllm") else v
            for k, v in together.items()
        }
        if not smallest or not _fits(stage, budget_gb, smallest):
            return []
        together = smallest
        for key in list(together):
            others = {k: v for k, v in together.items() if k != key}
            if others and _fits(stage, budget_gb, others):
                together = others
            elif key in _LARGEST:
                together[key] = (
                    _largest(dataclasses.replace(stage, **others), budget_gb, key) or together[key]
                )
        fitting = [together]
    return [
        Suggestion(
            {SETTING_OF.get(k, k): v for k, v in c.items()},
            plan(dataclasses.replace(stage, **c), budget_gb, suggest=False).total,
        )
        for c in fitting
    ]


# The stage's fields that a suggestion names by another setting of the job.
SETTING_OF = {"sampled_rows": "trace_batch_size"}
_LARGEST = ("sampled_rows", "eval_batch_size", "vllm_gpu_memory_utilization")


def _largest(stage: Stage, budget_gb: float, key: str) -> int | float:
    """The largest value of `key` below the stage's own that fits (a batch, or a share in steps of 0.05);
    0 when none does."""
    if key == "vllm_gpu_memory_utilization":
        shares = [pct / 100 for pct in range(round(stage.vllm_gpu_memory_utilization * 100) - 5, 4, -5)]
        return next((x for x in shares if _fits(stage, budget_gb, {key: x})), 0)
    return largest_batch(stage, budget_gb, key, getattr(stage, key) - 1)


def _fits(stage: Stage, budget_gb: float, change: dict[str, Any]) -> bool:
    return plan(dataclasses.replace(stage, **change), budget_gb, suggest=False).fits


@dataclass
class JobPlan:
    """A job's plan: every stage's (the stages follow one another) and the largest, which decides; `beside`:
    what is held at the same time elsewhere (a rollout producer on a device of its own, its queue in host
    memory, `producer_plans`), each of which must fit its own budget too."""

    plans: dict[str, Plan]
    beside: dict[str, Plan] = field(default_factory=dict)

    @property
    def stage(self) -> str:
        return max(self.plans, key=lambda name: self.plans[name].total)

    @property
    def plan(self) -> Plan:
        return self.plans[self.stage]

    @property
    def fits(self) -> bool:
        return self.plan.fits and all(p.fits for p in self.beside.values())

    def table(self) -> str:
        """What is held beside the stages (each with its own verdict), then the largest stage's table, headed
        by every stage's total; the last line is the verdict: the largest stage's, or the first plan beside
        it that does not fit."""
        lines = [f"beside the training process, {name}:\n{p.table()}" for name, p in self.beside.items()]
        head = "memory plan per process"
        if len(self.plans) > 1:
            totals = ", ".join(f"{name} {p.total / GB:.1f} GB" for name, p in self.plans.items())
            head += f", stages {totals}; the largest, {self.stage}:"
        else:
            head += f", {self.stage}:"
        lines.append(head + "\n" + self.plan.table())
        if self.plan.fits and not self.fits:
            name, p = self._failing()
            lines.append(f"{p.summary()} at {name}")
        return "\n".join(lines)

    def _failing(self) -> tuple[str, Plan]:
        """The first plan that does not fit: the largest stage's, or one beside it."""
        if not self.plan.fits:
            return self.stage, self.plan
        return next((name, p) for name, p in self.beside.items() if not p.fits)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "stage": self.stage,
            **self.plan.to_dict(),
            "stages": {k: p.to_dict() for k, p in self.plans.items()},
        }
        if self.beside:
            out["beside"] = {k: {**p.to_dict(), "where": p.where} for k, p in self.beside.items()}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def check(self) -> None:
        """Raise ConfigError, one line with the verdict and what would fit (the table is shown before), when
        the plan does not fit its budget."""
        if not self.fits:
            stage, plan = self._failing()
            fix = (
                f"it would fit with {'; '.join(map(str, plan.suggestions))}"
                if plan.suggestions
                else "no setting brings it under"
            )
            raise ConfigError(
                f"this run does not fit its memory budget, nothing has been loaded: {plan.summary()} at "
                f"{stage} (the plan above); {fix}; or use more processes or a larger GPU, or set "
                "plan_gpu_memory_gb if the budget is not this GPU's."
            )


def plan_job(stages: Mapping[str, Stage], budget: float | None, gpu_gb: float | None = None) -> JobPlan:
    """Plan each stage of a job against `budget` GB (None: nothing enforced). A vLLM engine's share is taken
    of `gpu_gb` (the visible card's memory, `card_gb`) when given, else of the budget; without a budget of
    this machine's memory, as vLLM on a CPU takes it."""
    plans, beside = {}, {}
    for name, stage in stages.items():
        if gpu_gb:
            stage = dataclasses.replace(stage, gpu_memory_gb=gpu_gb)
        if budget is None and stage.rollout_engine == "vllm":
            p = plan(stage, host_memory_gb(), suggest=False)
            p.budget_bytes = None
        else:
            p = plan(stage, budget)
        plans[name] = p
        for where, q in producer_plans(stage, budget).items():
            beside[where if len(stages) == 1 else f"{name}, {where}"] = q
    return JobPlan(plans, beside)


def producer_plans(stage: Stage, budget: float | None) -> dict[str, Plan]:
    """What a stage's rollout producer (`Stage.rollout_ahead`) holds away from the training process's
    device, by where: on a GPU of its own (`producer_place` gpu) the producer, against `budget` with its own
    reserve; in host memory the producer placed on the CPU, and always its queue (`queue_components`),
    neither checked against a budget. {} without a producer; one beside the trainer is in the stage's own
    plan."""
    if not stage.rollout_ahead:
        return {}
    out = {}
    sizing = budget if budget is not None else host_memory_gb()  # a vLLM share where no budget is set
    if stage.producer_place == "gpu":
        rows = producer_components(stage, sizing * GB)
        budget_bytes = None if budget is None else budget * GB
        if budget_bytes is not None:
            rows.append(_reserve_component(budget_bytes))
        out["the rollout producer on a GPU of its own"] = Plan(rows, budget_bytes)
    elif stage.producer_place == "cpu":
        rows = producer_components(stage, sizing * GB)
        out["the rollout producer on the CPU"] = Plan(rows, where="in host memory")
    out["the rollout producer's queue in host memory"] = Plan(queue_components(stage), where="in host memory")
    return out
