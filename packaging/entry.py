"""The frozen executable's entry point: the `ember` command."""
from ember.cli import main

main()
