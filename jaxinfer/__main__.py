"""`python -m jaxinfer`: the `jaxinfer` command."""

from jaxinfer.cli.main import main

main()
