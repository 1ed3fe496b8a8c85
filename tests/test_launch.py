"""Launching job functions in forked processes (accelerate's notebook launcher, gloo on CPU)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_forked_ranks_can_convert_weights_in_threads(tmp_path):
    """transformers loads weights by converting dtypes in a thread pool; in a process forked from one
    that had set torch's thread count, the first such calls race to rebuild torch's thread pool and one
    can fail ("Invalid thread pool!"), about one forked process in two without `launch`'s rebuild."""
    script = textwrap.dedent(f"""
        from concurrent.futures import ThreadPoolExecutor
        import torch
        from opdkit.launch import launch

        def convert_in_threads():
            xs = [torch.randn(300, 300) for _ in range(16)]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda x: x.to(torch.bfloat16), xs))

        torch.set_num_threads(1)
        torch.ones(100_000).to(torch.bfloat16)
        for i in range(4):  # 8 forked processes in all
            launch(convert_in_threads, (), 2, {str(tmp_path)!r} + f"/run{{i}}")
        print("all ranks converted")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "all ranks converted" in proc.stdout, proc.stderr[-3000:]
