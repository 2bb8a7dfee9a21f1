"""The C++ peer the benchmarks run beside the engine: llama.cpp's llama-bench on the bench's own weights."""
