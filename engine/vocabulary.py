"""The engine's words for its choices: backends, overflow policies, dtypes, weight formats, Core ML compute
units, search-vector poolings, progress phases, and the defaults every caller shares (chunk length, summary
tokens).

Config, the command line, the status view and the benchmarks offer and check these values; the engine
acts on them. Only names live here, no torch: importing this module stays cheap, so `npumoed --help`,
`npumoed status` and the config loader can use it without loading the engine.
"""

from __future__ import annotations

# Executor backends (`engine/backends/registry.py` registers one for each name).
CPU = "cpu"  # exact dynamic-shape experts, no static graphs
TORCH_STATIC = "torch-static"  # the static group graphs run by torch: the accelerators' reference
COREML = "coreml"  # the static group graphs run by Core ML on the Neural Engine
CUDA = "cuda"  # the static group graphs captured as CUDA graphs on an NVIDIA GPU
BACKENDS = (CPU, TORCH_STATIC, COREML, CUDA)
STATIC_BACKENDS = (TORCH_STATIC, COREML, CUDA)  # the backends that run group graphs, and so plans

# What happens to token-expert assignments over a tier's capacity.
SPILL = "spill"  # they run on the exact CPU path: nothing is lost
PRUNE = "prune"  # the least important are dropped
OVERFLOW_POLICIES = (SPILL, PRUNE)

# How a static backend's residency is decided.
MEASURED = "measured"  # a group runs on the accelerator where its measured cost is lower
ACCELERATOR = "accelerator"  # every group the backend can build runs there, whatever the costs say
RESIDENCY_POLICIES = (MEASURED, ACCELERATOR)

# Model and expert dtypes, spelled as torch spells them.
FLOAT32 = "float32"
BFLOAT16 = "bfloat16"
DTYPES = (FLOAT32, BFLOAT16)
# Short spellings the benchmark commands took before there was one; accepted there, never written out.
DTYPE_ALIASES = {"fp32": FLOAT32, "bf16": BFLOAT16}

# The format a model's weights run in. fp32 and bf16: every weight in that float dtype. int8 and int4: the routed
# experts quantized (on the CPU path), everything else in bf16. auto: chosen on the machine at load.
AUTO = "auto"
FP32, BF16, INT8, INT4 = "fp32", "bf16", "int8", "int4"
WEIGHTS = (AUTO, FP32, BF16, INT8, INT4)
QUANTIZED = (INT8, INT4)
WEIGHTS_DTYPE = {FP32: FLOAT32, BF16: BFLOAT16, INT8: BFLOAT16, INT4: BFLOAT16}  # the float dtype of each format
DTYPE_WEIGHTS = {FLOAT32: FP32, BFLOAT16: BF16}  # the format that runs every weight in a float dtype

# Defaults the engine, config, calibration, the command line and the benchmarks all start from.
CHUNK_TOKENS = 512  # prefill chunk length, and so the rows a timing run multiplies
SUMMARY_TOKENS = 128  # the most new tokens a summary may take

# Where Core ML may run a graph; each is the lower-case name of a `coremltools.ComputeUnit` member.
COMPUTE_UNITS = ("cpu_and_ne", "all", "cpu_only", "cpu_and_gpu")
DEFAULT_COMPUTE_UNITS = "cpu_and_ne"

# How a chunk's final hidden states become its search vector (engine/generate/pooling.py).
MEAN = "mean"  # the mean over the chunk's tokens
LAST = "last"  # the chunk's last token, which has read the section up to there
PROMPT = "prompt"  # PromptEOL: the last token of 'This passage : "<chunk>" means in one word:"', prefilled apart
POOLINGS = (MEAN, LAST, PROMPT)

# The phases a document's progress reports go through, in order.
PREFILL = "prefill"  # chunks prefilled
SUMMARY = "summary"  # sections summarised
REDUCE = "reduce"  # section summaries combined
PHASES = (PREFILL, SUMMARY, REDUCE)


def weights_with_dtype(weights: str, dtype: str | None) -> str:
    """The weights format that `weights` and the older `dtype` say together: a dtype beside weights auto pins its
    float format (float32: fp32, bfloat16: bf16); beside a format whose float dtype differs, ValueError."""
    if dtype is None:
        return weights
    if weights == AUTO:
        return DTYPE_WEIGHTS[dtype]
    if WEIGHTS_DTYPE[weights] != dtype:
        raise ValueError(f"dtype {dtype!r} disagrees with weights {weights!r}, whose float dtype is "
                         f"{WEIGHTS_DTYPE[weights]}")
    return weights


def dtype_name(spelling: str) -> str:
    """The one spelling of the dtype `spelling` names (an alias or the name itself)."""
    return DTYPE_ALIASES.get(spelling, spelling)
