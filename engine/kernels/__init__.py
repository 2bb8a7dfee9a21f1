"""The CPU kernels: the engine's C sources and their wrappers, the library kernels beside them, and the one
mechanism that chooses among them by measurement on this machine.
"""
