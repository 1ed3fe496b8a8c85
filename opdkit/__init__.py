"""opdkit: on-policy distillation and antidistillation, notebook first.

Notebooks in `notebooks/` call this package; every number they report is computed here.
"""

__version__ = "0.1.0"
