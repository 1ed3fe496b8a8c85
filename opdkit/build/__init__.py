"""Recipes that build what the kit ships: `tiny_world` trains the tiny world's teacher and student (its assets
in `opdkit/tiny/assets/`)."""
