"""Executor backends (cpu, torch-static, coreml, cuda) and placing a plan on one of them here."""
