"""The repository's scripts; those that use the loadtests package run as modules from the
repository's root (``python -m scripts.fuzz_api``)."""
