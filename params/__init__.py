"""The presets, `params/<job>/<mode>.yaml`; shipped inside the wheel as `opdkit.params` (see pyproject)."""
