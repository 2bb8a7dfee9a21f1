"""llama.cpp's tools as the benchmarks call them: llama-quantize, llama-bench's prompt-processing and generation
tests, llama-completion (llama-cli in older builds) writing from a prompt file, and llama-perplexity scoring a
text file.

The binaries come from `bench/peer/build-llama-cpp.sh` (or any llama.cpp build): a folder holding `llama-bench` and
`llama-quantize`, or holding them in `bin/`, named by `--peer DIR` or the NPUMOE_LLAMA_CPP environment variable.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_ENV = "NPUMOE_LLAMA_CPP"
TOOLS = ("llama-bench", "llama-quantize")
COMPLETION_TOOLS = ("llama-completion", "llama-cli")  # the one-shot text tool, newest name first
PERPLEXITY_TOOL = "llama-perplexity"
VERSION_FILE = "VERSION"  # written by build-llama-cpp.sh: the sdist's version and the build's flags


# llama-bench's switch for its repacked weights layouts (the AMX and CPU_REPACK buffers); off, every weight is used
# as the file holds it.
NO_REPACK = ("--repack", "0")


class ToolCrashed(RuntimeError):
    """A llama.cpp tool killed by a signal (not an error it reported itself)."""


@dataclass(frozen=True)
class LlamaCpp:
    bench: Path
    quantize: Path
    version: str  # the VERSION file's text, or where the binaries came from when there is none

    def describe(self) -> dict:
        """What the results' settings block records of the peer: its build, as the folder and the binary say."""
        built = subprocess.run([str(self.bench), "--version"], capture_output=True, text=True, timeout=60)
        return {"llama_bench": str(self.bench), "version": self.version,
                "llama_bench_version": " ".join((built.stdout + built.stderr).split())}


def find_llama_cpp(folder: Path) -> LlamaCpp:
    """The two tools in `folder` or `folder/bin`; a clear error naming what is missing."""
    for place in (folder, folder / "bin"):
        paths = [place / tool for tool in TOOLS]
        if all(path.is_file() for path in paths):
            missing = [str(path) for path in paths if not _executable(path)]
            if missing:
                raise ValueError(f"llama.cpp tools are not executable: {', '.join(missing)}")
            version_file = next((p / VERSION_FILE for p in (place, place.parent) if (p / VERSION_FILE).is_file()),
                                None)
            version = version_file.read_text().strip() if version_file else f"unrecorded (binaries in {place})"
            return LlamaCpp(bench=paths[0], quantize=paths[1], version=version)
    raise ValueError(f"no llama-bench and llama-quantize in {folder} or {folder / 'bin'}; build them with "
                     f"bench/peer/build-llama-cpp.sh")


def quantize(tool: LlamaCpp, source: Path, out: Path, type_name: str, *, threads: int) -> Path:
    """`source` requantized by llama-quantize to `type_name` (its own spelling: Q8_0, Q4_0, ...) as `out`."""
    _run([str(tool.quantize), str(source), str(out), type_name, str(threads)], "llama-quantize", timeout=3600)
    return out


def bench_command(tool: LlamaCpp, model: Path, *, tokens: int, chunk: int, threads: int, warmup: int,
                  repeats: int) -> list[str]:
    """llama-bench prefilling `tokens` random tokens in micro-batches of `chunk` (the KV cache carried across them,
    as the engine's chunked prefill does), no generation, `repeats` timed runs, JSON out."""
    command = [str(tool.bench), "-m", str(model), "-p", str(tokens), "-n", "0", "-b", str(tokens), "-ub", str(chunk),
               "-t", str(threads), "-r", str(repeats), "-o", "json"]
    return command if warmup else [*command, "--no-warmup"]  # llama-bench warms up once by default


def decode_command(tool: LlamaCpp, model: Path, *, tokens: int, depth: int, threads: int,
                   repeats: int) -> list[str]:
    """llama-bench generating `tokens` tokens one at a time after `depth` tokens already in the cache (its `-d`),
    no prompt test, `repeats` timed runs after its warm-up, JSON out."""
    return [str(tool.bench), "-m", str(model), "-p", "0", "-n", str(tokens), "-d", str(depth), "-t", str(threads),
            "-r", str(repeats), "-o", "json"]


def run_bench(command: list[str], *, tokens: int, generated: int = 0) -> dict:
    """llama-bench's result for the test of `tokens` prompt tokens and `generated` new ones: its JSON object, as it
    printed it."""
    output = _run(command, "llama-bench", timeout=7200)
    try:
        results = json.loads(output)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"llama-bench printed no JSON ({e}): {output[:300]!r}") from e
    found = [r for r in results
             if isinstance(r, dict) and r.get("n_prompt") == tokens and r.get("n_gen") == generated]
    if len(found) != 1 or not found[0].get("samples_ns"):
        raise RuntimeError(f"llama-bench's JSON holds no single test of {tokens} prompt and {generated} generated "
                           f"tokens with samples: {output[:300]!r}")
    return found[0]


def completion_tool(tool: LlamaCpp) -> Path | None:
    """llama.cpp's one-shot text tool beside llama-bench: llama-completion (newer builds), else llama-cli; None
    when the build has neither."""
    for name in COMPLETION_TOOLS:
        path = tool.bench.parent / name
        if path.is_file() and _executable(path):
            return path
    return None


def completion_command(path: Path, model: Path, prompt: Path, *, tokens: int, threads: int) -> list[str]:
    """The tool at `path` reading the prompt file `prompt` and writing exactly `tokens` tokens (greedy, the end of
    sequence ignored: the same budget whatever the weights say), one shot, no conversation."""
    command = [str(path), "-m", str(model), "-f", str(prompt), "-n", str(tokens), "-t", str(threads), "--temp", "0",
               "--ignore-eos", "--no-warmup"]
    return [*command, "-no-cnv"] if path.name == "llama-cli" else command


def perplexity_tool(tool: LlamaCpp) -> Path | None:
    """llama-perplexity beside llama-bench; None when the build has none."""
    path = tool.bench.parent / PERPLEXITY_TOOL
    return path if path.is_file() and _executable(path) else None


def perplexity_command(path: Path, model: Path, text: Path, *, context: int, threads: int,
                       tokens_file: Path) -> list[str]:
    """llama-perplexity on the text file `text` in chunks of `context` tokens, each chunk from an empty cache with
    its second half scored, saving what it evaluated to `tokens_file` (its `--kl-divergence-base` file: the
    tokens, then each scored position's log-probabilities), which `read_evaluated_tokens` reads back."""
    return [str(path), "-m", str(model), "-f", str(text), "-c", str(context), "-t", str(threads),
            "--kl-divergence-base", str(tokens_file)]


@dataclass(frozen=True)
class PerplexityRun:
    """What llama-perplexity said: its final estimate and its ± (the standard error it prints), the chunks it
    evaluated, and its load time (None where its log has no timestamps)."""
    perplexity: float
    error: float
    chunks: int
    context: int
    load_s: float | None


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
# llama.cpp's log stamps each line minutes.seconds.milliseconds.microseconds since the start; it prints no load time
# of its own here, so the load is the time until it starts tokenizing the text (the model read, its context made).
_TOKENIZING = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) \w perplexity: tokenizing the input", re.MULTILINE)


def parse_perplexity(output: str) -> PerplexityRun:
    """llama-perplexity's figures from what it printed (stdout and stderr together); RuntimeError quoting its end
    when its final estimate is not there."""
    final, chunks = _FINAL.search(output), _CHUNKS.search(output)
    if final is None or chunks is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate: {output.strip()[-500:]!r}")
    stamp = _TOKENIZING.search(output)
    minutes, seconds, ms, us = map(int, stamp.groups()) if stamp else (0, 0, 0, 0)
    load_s = ((minutes * 60 + seconds) * 10**6 + ms * 1000 + us) / 1e6 if stamp else None
    return PerplexityRun(perplexity=float(final[1]), error=float(final[2]), chunks=int(chunks[1]),
                         context=int(chunks[2]), load_s=load_s)


_LOGITS_MAGIC = b"_logits_"


def read_evaluated_tokens(path: Path) -> tuple[int, list[int]]:
    """(context, tokens) from the head of llama-perplexity's `--kl-divergence-base` file: its magic, n_ctx (int32),
    n_vocab (int32), n_chunk (int32), then the n_chunk·n_ctx tokens (int32) it evaluated, as its tokenizer cut the
    text (before it puts a BOS at the start of each chunk, where the model wants one)."""
    with path.open("rb") as f:
        magic = f.read(len(_LOGITS_MAGIC))
        if magic != _LOGITS_MAGIC:
            raise ValueError(f"{path}: not a llama-perplexity logits file (starts {magic!r})")
        context, _, chunks = struct.unpack("<iii", f.read(12))
        count = context * chunks
        data = f.read(4 * count)
    if len(data) != 4 * count:
        raise ValueError(f"{path}: {count} tokens announced, {len(data) // 4} there")
    return context, list(struct.unpack(f"<{count}i", data))


def run_perplexity(command: list[str]) -> ToolRun:
    """llama-perplexity's run to the end: its figures are on stdout and stderr (parse_perplexity)."""
    return _run_output(command, PERPLEXITY_TOOL, timeout=7200)


@dataclass(frozen=True)
class ToolRun:
    """What a tool printed, and its own peak resident memory (its children's and siblings' not counted)."""
    stdout: str
    stderr: str
    peak_rss: int  # bytes


def run_completion(command: list[str]) -> ToolRun:
    """The tool's run to the end: its timings are on stderr."""
    return _run_output(command, "llama-completion", timeout=7200)


def _run(command: list[str], name: str, *, timeout: float) -> str:
    return _run_output(command, name, timeout=timeout).stdout


def _run_output(command: list[str], name: str, *, timeout: float) -> ToolRun:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        expired = threading.Event()
        timer = threading.Timer(timeout, lambda: (expired.set(), process.kill()))
        timer.start()
        watch = _PeakWatch(process.pid)
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
            watch.stop()
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        peak = watch.peak if watch.peak is not None else usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        done = ToolRun(out.read(), err.read(), peak)
    if expired.is_set():
        raise subprocess.TimeoutExpired(command, timeout, done.stdout, done.stderr)
    if process.returncode < 0:
        raise ToolCrashed(f"{name} was killed by signal {-process.returncode}: {done.stderr.strip()[-300:]}")
    if process.returncode:
        raise RuntimeError(f"{name} failed ({process.returncode}): {done.stderr.strip()[-500:]}")
    return done


class _PeakWatch:
    """A running process's own high-water mark of resident memory, read from /proc while it runs (None where
    there is no /proc). Not its rusage: on Linux a child's ru_maxrss keeps the size of the process that forked it
    (the pages it had before exec), so a tool started by a large process would be reported as large as that."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.peak: int | None = None
        self._status = Path(f"/proc/{pid}/status")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every,), daemon=True)
        if self._status.parent.parent.is_dir():
            self._thread.start()

    def _watch(self, every: float) -> None:
        while not self._stop.is_set():
            try:
                text = self._status.read_text()
            except OSError:  # gone: the last reading stands
                return
            for line in text.splitlines():
                if line.startswith("VmHWM:"):  # kB; monotonic while the process lives
                    self.peak = int(line.split()[1]) * 1024
            self._stop.wait(every)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _executable(path: Path) -> bool:
    return path.stat().st_mode & 0o111 != 0
