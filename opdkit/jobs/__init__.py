"""The notebooks' jobs, one folder each, named as the job: `config.py` (its settings), `job.py` (`prepare`,
`run`, `process`, `main`), `report.py` (a finished run as tables, text and figures). A notebook first calls
`opdkit.notebook.progress.install()` (before anything imports tqdm.auto: importing a job installs nothing),
then its job's `parameters`, `prepare` and `run`, then its report. One name per job: its folder, config
class, entry point (`python -m opdkit.<job>`), presets (`params/<job>/`) and runs (`runs/<job>/`).

| notebook                | job         | config            |
|-------------------------|-------------|-------------------|
| 01_save_grad.ipynb      | savegrad    | SaveGradConfig    |
| 02_whitebox.ipynb       | whitebox    | WhiteboxConfig    |
| 03_clip_vs_noclip.ipynb | cliplesson  | ClipLessonConfig  |
| 04_antidistill.ipynb    | antidistill | AntidistillConfig |

Which room may import which (tests/test_layout.py checks it):
- a job imports the library (`opdkit.*` outside `jobs/`) and another job's package (e.g. `from opdkit.jobs
  import whitebox; whitebox.run(...)`), never another job's internals;
- the library imports no job (the `python -m opdkit.<job>` entry points are thin shims, not library);
- nothing below `if __name__ == "__main__":` but the call of `main`.
"""
