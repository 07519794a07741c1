"""`python -m pipeline` is the `pipeline` command."""

from pipeline.cli.main import main

main()
