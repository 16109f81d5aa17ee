"""Load tests and benchmarks of vcache, and the hosted-provider emulator.

A package: run its scripts from the repository's root as modules
(``python -m loadtests.run``, ``python -m loadtests.emulator``; README.md lists them).
"""
