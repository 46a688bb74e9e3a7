"""In a wheel: the code the CLI shares with the Lambdas and the images (core, contracts, trainer), its
imports renamed at build time (setup.py, docs/packaging.md). Empty in a checkout, which imports them by
their own top-level names."""
