"""What the notebooks show: `parameters` (the parameters cell), `live` (the figure redrawn while training),
`widgets` (ipywidgets views), `figures` (generic figures of a run), `demo` (`make demo`)."""
