"""Helpers the tests share: simulated CPUs, writers of test documents and models, servers, the demo run."""
