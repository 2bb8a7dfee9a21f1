"""Executor backends (cpu, torch-static, coreml) and placing a plan on one of them here."""
