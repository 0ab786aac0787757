"""Models bundled with jaxinfer, installed as the package data of `jaxinfer.models` (see pyproject.toml).

Kept free of imports so the CLI can name the default in its --help without loading jax.
"""

DEFAULT = "stdlib-llama-11m"  # trained by scripts/train_default_model.py
