"""The data files the full and ads-paper presets read, written from the Hugging Face Hub where it is
reachable.

    python -m opdkit.data.prepare --out data/                      # every file below
    python -m opdkit.data.prepare --out data/ --only gsm8k-platinum-test.parquet
    # from a local copy: mirror/<owner>/<name>/<config>/
    python -m opdkit.data.prepare --out data/ --local-hub mirror/

    dapo-math-17k-unique.parquet   BytedTsinghua-SIA/DAPO-Math-17k (train), one row per distinct prompt, first
                                   occurrence kept, the original verl schema (prompt, reward_model,
                                   ...): 02, 01 full
    gsm8k-main-train.parquet       openai/gsm8k main train: 01 ads-paper's holdout, 04's training prompts
    gsm8k-main-test.parquet        openai/gsm8k main test: 04's evaluation where GSM8K-Platinum is not
                                   available
    gsm8k-platinum-test.parquet    madrylab/gsm8k-platinum main test (1,209 problems): 04's evaluation,
                                   as the ADS reference

A file that exists is kept (pass --overwrite to replace it); a file is written whole or not at all. Sources
that cannot be fetched are reported, the others still written; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from opdkit.run.files import atomic_path


@dataclass(frozen=True)
class Source:
    repo: str  # Hub dataset id
    config: str | None
    split: str
    dedup_prompts: bool = False


FILES: dict[str, Source] = {
    "dapo-math-17k-unique.parquet": Source(
        "BytedTsinghua-SIA/DAPO-Math-17k", None, "train", dedup_prompts=True
    ),
    "gsm8k-main-train.parquet": Source("openai/gsm8k", "main", "train"),
    "gsm8k-main-test.parquet": Source("openai/gsm8k", "main", "test"),
    "gsm8k-platinum-test.parquet": Source("madrylab/gsm8k-platinum", "main", "test"),
}


def load_source(src: Source, local_hub: Path | None = None) -> datasets.Dataset:
    """The source's split from the Hub, or from `local_hub/<owner>/<name>/<config or default>/` (data files
    named by split, e.g. train.parquet), a local copy laid out like the Hub's ids."""
    if local_hub is None:
        return datasets.load_dataset(src.repo, src.config, split=src.split)
    folder = Path(local_hub) / src.repo / (src.config or "default")
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no local copy of {src.repo} at {folder}; expected data files named by split there."
        )
    return datasets.load_dataset(str(folder), split=src.split)


def prompt_keys(ds: datasets.Dataset) -> list[str]:
    """The text each row is deduplicated by: the `prompt` string, or the first message's content."""
    col = ds.data.table.column("prompt")
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        col = pc.struct_field(pc.list_element(col, 0), "content")
    return col.to_pylist()


def unique_prompts(ds: datasets.Dataset) -> datasets.Dataset:
    """One row per distinct prompt, the first of each, in the original order (DAPO-Math-17k repeats every
    prompt about 100 times)."""
    if "prompt" not in ds.column_names:
        raise ValueError(
            f"cannot deduplicate by prompt: the columns are {ds.column_names}, expected a 'prompt' column."
        )
    seen: set[str] = set()
    keep = []
    for i, key in enumerate(prompt_keys(ds)):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return ds.select(keep)


def write_parquet(ds: datasets.Dataset, path: Path) -> None:
    """`ds` as a parquet file at `path`, atomically: a reader sees the whole file or none."""
    with atomic_path(path) as tmp:
        ds.to_parquet(str(tmp))


def prepare(
    out: Path, names: list[str] | None = None, local_hub: Path | None = None, overwrite: bool = False
) -> dict[str, str]:
    """Write the files `names` (all of `FILES` by default) into `out`; returns {file: what happened}."""
    unknown = sorted(set(names or []) - set(FILES))
    if unknown:
        raise ValueError(f"unknown data files {unknown}; valid: {sorted(FILES)}.")
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for name in names or list(FILES):
        report[name] = _prepare_one(name, FILES[name], out / name, local_hub, overwrite)
        print(f"{name}: {report[name]}", flush=True)
    return report


def _prepare_one(name: str, src: Source, path: Path, local_hub: Path | None, overwrite: bool) -> str:
    if path.exists() and not overwrite:
        return "kept (exists; --overwrite replaces it)"
    try:
        ds = load_source(src, local_hub)
    except Exception as exc:  # any failure to fetch is reported, and the other files are still written
        return (
            f"FAILED: could not load {src.repo} ({src.config or 'default'}, {src.split}): "
            f"{type(exc).__name__}: {exc}"
        )
    rows = len(ds)
    if src.dedup_prompts:
        ds = unique_prompts(ds)
    write_parquet(ds, path)
    kept = f", {len(ds)} unique prompts of {rows} rows" if src.dedup_prompts else f", {rows} rows"
    return f"written from {src.repo}{kept}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data", type=Path, help="folder the files go to (default: data)")
    p.add_argument("--only", nargs="*", default=None, metavar="FILE", help=f"some of: {', '.join(FILES)}")
    p.add_argument(
        "--local-hub", type=Path, default=None, help="read a local copy laid out as <owner>/<name>/<config>/"
    )
    p.add_argument("--overwrite", action="store_true", help="replace files that exist")
    a = p.parse_args(argv)
    report = prepare(a.out, a.only, a.local_hub, a.overwrite)
    failed = [n for n, r in report.items() if r.startswith("FAILED")]
    if "gsm8k-platinum-test.parquet" in failed:
        print(
            "without GSM8K-Platinum, run 04 with -p eval_dataset_path data/gsm8k-main-test.parquet "
            "(GSM8K test, 1,319 problems; a difference from the ADS reference)."
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
