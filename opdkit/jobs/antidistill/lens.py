"""Which tokens ADS changes, one training prompt at a time, with a finished run's teacher and gradient
(`TokenLens`; the report shows its comparisons as a figure, HTML and a widget: `report.token_changes`).

    lens = TokenLens(run); c = lens.compare(0, lam=0.1, seed=0)
"""

from __future__ import annotations

from pathlib import Path

from opdkit import tasks
from opdkit.ads import sampler
from opdkit.data import prompts
from opdkit.jobs.antidistill import sweep
from opdkit.models import eos_ids, load_tokenizer
from opdkit.run.folders import RunDir


class TokenLens:
    """Which tokens ADS changes, one training prompt at a time, with a finished run's teacher and gradient.

        lens = TokenLens(run)
        c = lens.compare(0, lam=0.1, seed=0)   # {"tokens": [{"text", "plain_text", "changed", ...}], ...}

    ADS and plain sampling share their random noise at every step (`sampler.coupled_sample`), so a token is
    marked changed exactly where the ADS term moved the draw; the trace goes on with the ADS token.
    """

    def __init__(self, run: RunDir | str | Path, num_prompts: int = 8):
        self.cfg, _ = sweep.load_run_config(run)
        cfg, self.device = self.cfg, sweep.device()
        self.tokenizer = load_tokenizer(cfg.teacher_model)
        self.task = tasks.for_dataset(cfg.dataset_path)
        messages, answers = sweep.training_prompts(cfg, self.task)
        self.messages, self.answers = messages[:num_prompts], answers[:num_prompts]
        run = RunDir.attach(cfg.run_dir)
        proxy_tok = load_tokenizer(cfg.proxy_model)
        student_tok = load_tokenizer(cfg.student_tokenizer or cfg.student_model)
        self.steering, _ = sweep.load_steering(
            cfg, proxy_tok, student_tok, sweep.grads_path(cfg, run), self.device, run
        )

    @property
    def labels(self) -> list[str]:
        return [m[-1]["content"][:60] for m in self.messages]

    def _trace(self, index: int, lam: float, seed: int, method: str) -> list[dict]:
        cfg = self.cfg
        ids = prompts.prompt_ids(self.tokenizer, self.messages[index], cfg.enable_thinking)
        tau = cfg.ads_temperatures[0] if cfg.ads_temperatures else 1.0
        direction = self.steering.direction(sweep.GRADIENTS[method]) if lam else None
        return sampler.coupled_sample(
            self.steering.teacher,
            direction,
            ids,
            lam=lam,
            temperature=tau,
            top_p=cfg.trace_top_p,
            top_k=cfg.trace_top_k,
            eos_token_id=eos_ids(self.tokenizer, self.steering.teacher),
            max_new_tokens=cfg.trace_max_new_tokens,
            seed=seed,
        )

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def compare(self, index: int, lam: float, seed: int = 0, method: str = "ads") -> dict:
        """The ADS trace at λ with its changed tokens, and the plain trace drawn with the same noise; `method`
        "ads-answer" and "ads-confident" steer by the derived gradients (`sweep.GRADIENTS`)."""
        if method not in sweep.GRADIENTS:
            raise ValueError(f"method={method!r} is not one of {sorted(sweep.GRADIENTS)}.")
        steps, plain = self._trace(index, lam, seed, method), self._trace(index, 0.0, seed, method)
        tokens = [
            {
                "text": self._text(s["token"]),
                "plain_text": self._text(s["plain_token"]),
                "changed": s["token"] != s["plain_token"],
                "p_ads": s["p_ads"],
                "p_plain": s["p_plain"],
                "p_plain_choice": s["p_plain_choice"],
            }
            for s in steps
        ]
        check, answer = self.task.check, self.answers[index]
        text = self.tokenizer.decode([s["token"] for s in steps], skip_special_tokens=True)
        plain_text = self.tokenizer.decode([s["token"] for s in plain], skip_special_tokens=True)
        return {
            "prompt": self.labels[index],
            "answer": answer,
            "lam": lam,
            "seed": seed,
            "method": method,
            "temperature": self.cfg.ads_temperatures[0] if self.cfg.ads_temperatures else 1.0,
            "tokens": tokens,
            "completion": text,
            "plain_completion": plain_text,
            "correct": check(text, answer) if answer else None,
            "plain_correct": check(plain_text, answer) if answer else None,
        }
