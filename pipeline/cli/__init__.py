"""The `pipeline` command: `main` is the console script's entry point (`pipeline.cli:main` in pyproject.toml)."""

from pipeline.cli.main import main

__all__ = ["main"]
