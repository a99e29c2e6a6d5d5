"""``armkv bench decode``: what the cache costs as the context grows (the paper's figure 3).

For every method at one budget, on one model:

(a) cache bytes and per-token decode latency against generation length (one decode from a
    few-token prompt, read at each ``--gen-lengths`` point);
(b) per-token decode latency after a prompt of each ``--lengths`` (random token ids, or a
    text's with ``--prompt-file``: beyond the model's trained positions only the cost
    matters, so the position limit is raised for the run and put back after);
(c) prefill throughput over that prompt under the budgeted chunked prefill (the prompt goes
    to the model ``chunk`` tokens per forward, so activations and cache stay bounded);
(d) the floor: decode latency of the same model with a context of a few tokens, where the
    weights, not the cache, bound the step;
(e) for armkv's caches, after the timed steps of (b), ``repeats`` more steps with each layer's
    attention timed apart (the read of its state and, on the steps that write, the write),
    within it ARM's reads of its memory alone, and for ARM, over ``repeats`` steps more, the
    share of its occupied slots the reads touched: what a sparse read (M < N_b) saves,
    without the rest of the model's step around it.

The ``native`` row is the baseline a user has without armkv: the same model with transformers'
own cache (``DynamicCache``, or ``StaticCache`` with ``--option native.cache=static``), timed
under the same protocol; its prompt goes in one forward (``--option native.chunk=N`` splits it).
The model is a local folder, the default model, or a random-weight model of a shipped shape
(``--model-config llama-3.1-8b``, :func:`armkv.hf.model.build_model_from_config`). With
``--batch B`` every step feeds B sequences: latency is per step, throughput ``B / step``.

Latency is the median of ``repeats`` timed steps after ``warmup`` untimed ones. A step is
one forward of one token whose id comes from the previous step's argmax on the device, so
on CUDA the only host sync in a timed step is the ``torch.cuda.synchronize`` that ends it.
The last stdout line is one JSON document (:func:`run_bench`'s result).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from armkv.errors import ArmkvError
from armkv.memory.kernels import describe as describe_int4_read

NATIVE = "native"  # transformers' own cache, no armkv: not a registered method
NATIVE_CACHES = ("dynamic", "static")
DEFAULT_METHODS = "native,full,swa,sink,kivi,arm"
DEFAULT_LENGTHS = "1024,2048,4096,8192,16384,32768"
DEFAULT_GEN_LENGTHS = "64,128,256,512,1024"


@dataclass
class DecodeBench:
    """One run of the decode benchmark; validated on construction."""

    methods: list[str]
    lengths: list[int]  # prompt lengths of (b) and (c)
    gen_lengths: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])  # points of (a)
    budget: int | None = 512  # token-equivalents per layer (None: unbounded methods only)
    chunk: int = 256  # P: prefill chunk, one model forward each
    # timed decode steps per point: the median is reported, and the mean beside it; 16 = ARM's
    # sync at budget 512, so the mean counts one write of every layer (the median none)
    repeats: int = 16
    warmup: int = 2  # untimed decode steps before them
    floor_context: int = 4  # prompt tokens of the floor (d) and of the generation curve (a)
    max_full_length: int | None = None  # no prefill of unbounded methods (full, offload) past this prompt length
    beyond_full: str = "skip"  # there: "skip" the point, or "fill" the full cache with random KV and time decode only
    max_length: int = 131072  # refuse prompt lengths past this (a typo guard, not a model limit)
    clock: str = "wall"  # "wall", or "process": CPU time of the process (a CPU shared with other jobs)
    seed: int = 0
    options: dict[str, dict] = field(default_factory=dict)  # method -> its make_cache options (--option arm.sync=32)
    batch: int = 1  # sequences decoded together (every step feeds one token of each)
    compile: bool = False  # bounded methods decode through their torch.compile'd step (make_cache(compile=True))
    prompt_ids: list[int] | None = None  # the prompts' tokens (a text's, repeated to length); None: random ids
    prompt_name: str = "random ids"  # what they are, for the settings

    def __post_init__(self) -> None:
        from armkv.methods.base import get_method

        if self.budget is not None and self.budget < 1:
            raise ArmkvError(f"--budget {self.budget} must be >= 1 token-equivalent")
        if not self.methods:
            raise ArmkvError("--methods is empty: name at least one method")
        if len(set(self.methods)) != len(self.methods):
            raise ArmkvError(f"--methods {','.join(self.methods)} names a method twice")
        for name in self.methods:
            if name != NATIVE:
                get_method(name)  # one-line error for an unknown method
        check_native_options(self.options.get(NATIVE, {}))
        if self.batch < 1:
            raise ArmkvError(f"--batch {self.batch} must be >= 1")
        for name, opts in self.options.items():
            if name not in self.methods:
                raise ArmkvError(
                    f"--option {name}.{next(iter(opts))}=...: {name!r} is not among --methods {','.join(self.methods)}"
                )
        if not self.lengths:
            raise ArmkvError("--lengths is empty: give at least one prompt length")
        for what, values in (("--lengths", self.lengths), ("--gen-lengths", self.gen_lengths)):
            for n in values:
                if n < 1:
                    raise ArmkvError(f"{what} {n}: lengths must be >= 1")
                if n > self.max_length:
                    raise ArmkvError(f"{what} {n} is beyond the limit of {self.max_length} tokens (raise --max-length)")
        if self.repeats < 1 or self.warmup < 0:
            raise ArmkvError(f"--repeats {self.repeats} must be >= 1 and --warmup {self.warmup} >= 0")
        if self.chunk < 1:
            raise ArmkvError(f"--chunk {self.chunk} must be >= 1")
        if self.beyond_full not in ("skip", "fill"):
            raise ArmkvError(f"--beyond-full {self.beyond_full!r} is not one of skip, fill")
        if self.beyond_full == "fill" and any(not is_bounded(m) and m not in ("full", NATIVE) for m in self.methods):
            raise ArmkvError("--beyond-full fill fills the full and native caches only: leave offload out or use skip")
        if self.clock not in ("wall", "process"):
            raise ArmkvError(f"--clock {self.clock!r} is not one of wall, process")
        if self.floor_context < 1:
            raise ArmkvError(f"--floor-context {self.floor_context} must be >= 1")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ArmkvError(f"--prompt-file {self.prompt_name}: no tokens in it; give a file of text")
        if self.max_full_length is not None and self.max_full_length < 1:
            raise ArmkvError(f"--max-full-length {self.max_full_length} must be >= 1")
        self.lengths = sorted(set(self.lengths))
        self.gen_lengths = sorted(set(self.gen_lengths))

    def beyond(self, method: str, length: int) -> bool:
        """Whether an unbounded method is past --max-full-length at this prompt length."""
        return self.max_full_length is not None and length > self.max_full_length and not is_bounded(method)

    def skips(self, method: str, length: int) -> bool:
        """Whether this point is not measured at all (past --max-full-length, --beyond-full skip)."""
        return self.beyond(method, length) and self.beyond_full == "skip"

    def fills(self, method: str, length: int) -> bool:
        """Whether the prompt is replaced by random keys and values (past --max-full-length, fill)."""
        return self.beyond(method, length) and self.beyond_full == "fill"

    def native_option(self, key: str):
        """An option of the ``native`` row: ``cache`` (dynamic unless a compiled run asks for
        static) or ``chunk`` (None: the whole prompt in one forward)."""
        opts = self.options.get(NATIVE, {})
        if key == "cache":
            return opts.get("cache") or ("static" if getattr(self, "compile", False) else "dynamic")
        return opts.get(key)

    def positions_needed(self) -> int:
        decode = self.warmup + 4 * self.repeats  # timed, attention timed apart, reads counted, paired reads (twice)
        return max(max(self.lengths) + decode, self.floor_context + max(max(self.gen_lengths), decode)) + 1


# ---------------------------------------------------------------------- the native row
def is_bounded(method: str) -> bool:
    """Whether a method's cache stays within its budget (``native`` grows like full)."""
    from armkv.methods.base import get_method

    return method != NATIVE and get_method(method).bounded


def check_native_options(options: dict) -> None:
    """The ``native`` row takes ``cache`` (dynamic, static) and ``chunk`` (prompt tokens per forward)."""
    for key, value in options.items():
        if key == "cache":
            if value not in NATIVE_CACHES:
                raise ArmkvError(f"--option native.cache={value}: expected one of {', '.join(NATIVE_CACHES)}")
        elif key == "chunk":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArmkvError(f"--option native.chunk={value}: expected a whole number of tokens >= 1")
        else:
            raise ArmkvError(f"--option native.{key}: the native row takes only cache= and chunk=")


def native_cache(model, kind: str, max_length: int):
    """transformers' own cache for ``model``: a ``DynamicCache`` that grows, or a ``StaticCache``
    of ``max_length`` tokens allocated at the first forward (what a compiled step needs)."""
    from armkv.hf.compat import transformers

    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=max_length)
    return transformers.DynamicCache(config=model.config)


def cache_state_bytes(cache) -> int:
    """Bytes a cache holds now: an armkv cache's own count, or the key and value tensors of a
    transformers cache (a static one holds its whole length from the start)."""
    if hasattr(cache, "state_bytes"):
        return cache.state_bytes()
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def cache_peak_bytes(cache) -> int:
    """The largest size a cache reached: an armkv cache tracks it per layer; a transformers
    cache never shrinks, so it is its size now."""
    if hasattr(cache, "peak_bytes"):
        return cache.peak_bytes()
    return cache_state_bytes(cache)


# ---------------------------------------------------------------------- measurement
class Clock:
    """Time of device work: on CUDA each reading waits for the queued kernels first.

    ``kind="process"`` reads the CPU time of this process (all its threads) instead of the
    wall clock: on a CPU shared with other jobs it counts the work a step needs, not the
    time it waited for a core.
    """

    def __init__(self, device: torch.device, kind: str = "wall"):
        if kind not in ("wall", "process"):
            raise ArmkvError(f"--clock {kind!r} is not one of wall, process")
        if kind == "process" and device.type != "cpu":
            raise ArmkvError("--clock process measures CPU work: use it with --device cpu")
        self.cuda = device.type == "cuda"
        self.read = time.perf_counter if kind == "wall" else time.process_time

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self.read()


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_freed_memory() -> None:
    """Hand memory freed by the allocator back to the system (glibc's malloc_trim), so that
    the resident set, and a peak read after it, counts only what is still in use."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_rss() -> int:
    """Peak resident set size in bytes: since the last reset where it worked, else of the process."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def _overriding(overrides):
    """Set each (object, name, value) as an instance attribute (over the class's method of that
    name) for the block, then remove it."""
    try:
        for obj, name, value in overrides:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, _ in overrides:
            if name in vars(obj):
                delattr(obj, name)


class Session:
    """A model and what is needed to run it token by token through one cache."""

    def __init__(self, model, bench: DecodeBench):
        self.model, self.bench = model, bench
        self.device = model.device
        self.clock = Clock(self.device, bench.clock)
        vocab = model.config.get_text_config(decoder=True).vocab_size
        self.generator = torch.Generator().manual_seed(bench.seed)
        # ids from the upper part of the vocabulary keep clear of special tokens
        self.vocab_low, self.vocab_high = min(vocab - 1, 16), vocab

    def cache(self, method: str, horizon: int | None = None):
        """A fresh cache of ``method``; ``horizon`` (the tokens it will see) sizes a static
        ``native`` cache and is ignored by the others."""
        from armkv.hf.attach import detach, make_cache

        if method == NATIVE:
            # the model as transformers runs it (an attached model would route through armkv's
            # attention function, which hands other caches to sdpa, with a little more Python)
            detach(self.model)
            kind = self.bench.native_option("cache")
            return native_cache(self.model, kind, horizon or self.bench.positions_needed())
        from armkv.methods.base import get_method

        compile = self.bench.compile and get_method(method).bounded
        options = self.bench.options.get(method, {})
        return make_cache(self.model, method, self.bench.budget, self.bench.chunk, compile=compile, **options)

    def prefill_chunk(self, method: str, length: int) -> int:
        """Tokens per forward of a prompt: P, or for ``native`` the whole prompt unless its chunk option says."""
        if method == NATIVE:
            return self.bench.native_option("chunk") or length
        return self.bench.chunk

    def random_ids(self, n: int) -> torch.Tensor:
        """[batch, n] random token ids on the device."""
        ids = torch.randint(self.vocab_low, self.vocab_high, (self.bench.batch, n), generator=self.generator)
        return ids.to(self.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """ids [B, T], positions [1, T] on the device -> the next token [B, 1] (argmax, on the device)."""
        from armkv.hf.cache import ArmkvCache
        from armkv.hf.compat import cache_arg

        if isinstance(cache, ArmkvCache):  # (a decode step of a cache made with `compile`: the compiled forward)
            out = cache.forward(self.model, ids, position_ids=positions, use_cache=True, logits_to_keep=1)
        else:
            out = self.model(
                input_ids=ids, position_ids=positions, **cache_arg(cache), use_cache=True, logits_to_keep=1
            )
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def prompt(self, n: int) -> torch.Tensor:
        """[batch, n] prompt ids on the device: random ids, or the first n of the prompt
        text's tokens (repeated from its start where it is shorter)."""
        if self.bench.prompt_ids is None:
            return self.random_ids(n)
        text = torch.tensor(self.bench.prompt_ids, dtype=torch.long)
        ids = text.repeat(-(-n // len(text)))[:n]
        return ids.expand(self.bench.batch, n).to(self.device)

    def prefill(self, cache, length: int, progress=None, chunk: int | None = None) -> tuple[torch.Tensor, float]:
        """Feed a prompt of ``length`` tokens (:meth:`prompt`) in chunks of ``chunk`` (default
        P). Returns (next token [B, 1], seconds)."""
        ids = self.prompt(length)
        positions = torch.arange(length, device=self.device)[None]
        chunk = chunk or self.bench.chunk
        start = self.clock()
        for s in range(0, length, chunk):
            token = self.forward(ids[:, s : s + chunk], positions[:, s : s + chunk], cache)
            if progress is not None:
                progress(min(chunk, length - s))
        return token, self.clock() - start

    def fill(self, cache, length: int, progress=None) -> torch.Tensor:
        """Give every layer of a ``full`` (or ``native``) cache ``length`` random keys and values,
        as if a prompt had been read: the decode step then costs what it costs at that context,
        without the quadratic prefill. Returns a token to decode from [B, 1]."""
        from armkv.hf.attach import model_info
        from armkv.hf.cache import ArmkvCache
        from armkv.methods.full import FullLayer

        info = model_info(self.model)
        shape = (self.bench.batch, info.num_kv_heads, length, info.head_dim)

        def randn():
            return torch.randn(shape, generator=self.generator).to(self.device, self.model.dtype)

        for i, layer in enumerate(cache.layers):
            if not isinstance(cache, ArmkvCache):
                cache.update(randn(), randn(), i)  # transformers' cache stores them as a prompt's
                continue
            if not isinstance(layer, FullLayer):
                raise ArmkvError(f"--beyond-full fill needs the full cache, not {type(layer).__name__}")
            layer.keys, layer.values = randn(), randn()
            layer.valid = torch.ones(self.bench.batch, length, dtype=torch.bool, device=self.device)
            layer.seen = length
            layer.note_peak()
        if progress is not None:
            progress(length)
        return self.random_ids(1)

    def decode(self, cache, token: torch.Tensor, start: int, steps: int, progress=None):
        """``steps`` decode steps of all B sequences from position ``start``. Returns (the seconds
        of each step, the next token [B, 1])."""
        positions = torch.arange(start, start + steps, device=self.device)[None]
        times = []
        for i in range(steps):
            t0 = self.clock()
            token = self.forward(token, positions[:, i : i + 1], cache)
            times.append(self.clock() - t0)
            if progress is not None:
                progress(1)
        return times, token

    def attention(self, cache, token: torch.Tensor, start: int, steps: int, progress=None):
        """``steps`` more decode steps with the cache's attention timed apart: each layer's
        ``attend`` (the read of its state, and on the steps that write, the write) on the
        session's clock, summed over the layers; and within it, ARM's read of its memory
        alone (the layer's ``reader.read``: the slots, the exact entries and their
        one softmax), without the window's update or the write. On an armkv cache only (None
        for transformers' own). Returns (the median seconds a step spends in attention, the
        median in ARM's reads or None, the share of their occupied slots that ARM's reads
        touched or None, the next token [B, 1]). The share is counted over ``steps`` steps more,
        untimed (counting costs host work a read does not do). Where ARM's reads are sparse
        (M < N_b), 2 ``steps`` steps more make each of its reads and the dense read of every
        slot of the same state on the same inputs (``reader.dense``: the read a sparse
        one saves, of the same pool; a pool that reserves bytes for a sparse read's index and
        entries holds fewer slots than one that reads every bucket), one after the other, the
        first of the two in turn (:meth:`_paired_reads`). Returns also, last, (the median a step
        of the sparse reads, of the dense ones, each timed in the steps where it ran first, and
        dense / sparse of those medians), or Nones."""
        from armkv.hf.cache import ArmkvCache

        layers = getattr(cache, "layers", None)
        if not isinstance(cache, ArmkvCache) or not layers:
            return None, None, None, token, (None, None, None)
        spent = [0.0, 0.0]  # attention, ARM's reads

        def timed(fn, k):
            def run(*args, **kwargs):
                t0 = self.clock()
                out = fn(*args, **kwargs)
                spent[k] += self.clock() - t0
                return out

            return run

        tallied = [layer for layer in layers if hasattr(layer, "reader")]  # ARM's layers
        paired = (None, None, None)
        positions = torch.arange(start, start + 4 * steps, device=self.device)[None]
        try:
            with contextlib.ExitStack() as hooks:
                hooks.enter_context(_overriding([(layer, "attend", timed(layer.attend, 0)) for layer in layers]))
                for layer in tallied:  # (every read of the memory: the dense one, or at M < N_b the top-M one)
                    hooks.enter_context(layer.reader.hooks(read=lambda read: timed(read, 1)))
                rows, token = self._timed_steps(cache, token, positions[:, :steps], spent, progress)
                per_step, read_step = [r[0] for r in rows], [r[1] for r in rows]
                for layer in tallied:
                    layer.read_tally = [0, 0]
                _, token = self._timed_steps(cache, token, positions[:, steps : 2 * steps], spent, progress)
                read, occupied = (sum(layer.read_tally[k] for layer in tallied) for k in (0, 1))
        finally:
            for layer in tallied:
                layer.read_tally = None
        if read < occupied:  # sparse reads: each beside the dense read of the same state
            *paired, token = self._paired_reads(cache, tallied, token, positions[:, 2 * steps :], progress)
        reads = statistics.median(read_step) if tallied else None
        return statistics.median(per_step), reads, (read / occupied if occupied else None), token, paired

    def _timed_steps(self, cache, token: torch.Tensor, positions: torch.Tensor, spent: list, progress=None):
        """One decode step per position of ``positions`` [1, n], ``spent`` (the timers the
        caller's wrappers add to) zeroed before each. Returns (each step's ``spent`` as a tuple,
        the next token [B, 1])."""
        rows = []
        for i in range(positions.shape[1]):
            spent[:] = [0.0] * len(spent)
            token = self.forward(token, positions[:, i : i + 1], cache)
            rows.append(tuple(spent))
            if progress is not None:
                progress(1)
        return rows, token

    def _paired_reads(self, cache, layers, token: torch.Tensor, positions: torch.Tensor, progress=None):
        """:meth:`attention`'s paired steps, one per position of ``positions`` [1, n]: in
        ``layers`` each decoded token's sparse read and the dense read of the same state on the
        same inputs (its output dropped), one right after the other, the sparse read first in
        even steps and the dense one first in odd steps. Each read is timed in the steps where
        it runs first, as a decode step makes it: the second finds what the first just loaded
        of the same pool in the CPU's caches (the ranking's rows, the chosen slots), and timed
        second either read measured cheaper (at 16k the sparse one by a fifth, the dense one by
        an eighth). Returns (the median seconds a step of the sparse reads, of the dense ones,
        dense / sparse of those medians, the next token [B, 1])."""
        spent, step = [0.0, 0.0], [0]

        def paired(layer, read):
            def run(query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, *args, **kwargs):
                if query.shape[2] != 1:  # (only decode steps pair)
                    return read(
                        query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, *args, **kwargs
                    )
                dense_first = step[0] % 2 == 1
                if dense_first:
                    t0 = self.clock()
                    layer.reader.dense(query, key, value, valid, scaling, exact_k, exact_v, exact_valid)
                    spent[1] += self.clock() - t0
                t0 = self.clock()
                out = read(query, key, value, valid, positions, scaling, exact_k, exact_v, exact_valid, *args, **kwargs)
                spent[0] += self.clock() - t0
                if not dense_first:
                    layer.reader.dense(query, key, value, valid, scaling, exact_k, exact_v, exact_valid)
                return out

            return run

        rows = []
        with contextlib.ExitStack() as hooks:
            for layer in layers:
                hooks.enter_context(layer.reader.hooks(read=lambda read, layer=layer: paired(layer, read)))
            for i in range(positions.shape[1]):
                step[0] = i
                row, token = self._timed_steps(cache, token, positions[:, i : i + 1], spent, progress)
                rows += row
        sparse = [r[0] for i, r in enumerate(rows) if i % 2 == 0 and r[0] > 0]
        dense = [r[1] for i, r in enumerate(rows) if i % 2 == 1 and r[1] > 0]
        if not sparse or not dense:
            return None, None, None, token
        sparse, dense = statistics.median(sparse), statistics.median(dense)
        return sparse, dense, dense / sparse, token


# the per-prompt-length entries of the result: {method: {length: value or None}}
POINT_KEYS = (
    "decode_ms_per_token",
    "decode_mean_ms_per_token",
    "decode_tokens_per_s",
    "cache_bytes",
    "peak_cache_bytes",
    "prefill_tokens_per_s",
    "attention_ms_per_token",
    "read_ms_per_token",
    "read_share",
    "paired_read_ms_per_token",
    "dense_read_ms_per_token",
    "dense_read_ratio",
)


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def _device_peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _device_peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _extend_positions(model, needed: int) -> int:
    """Raise the config's position limit to ``needed`` (RoPE is computed from the ids, so the
    cost is that of a longer context); returns the old limit to put back."""
    config = model.config.get_text_config(decoder=True)
    old = config.max_position_embeddings
    config.max_position_embeddings = max(old, needed)
    return old


def run_bench(model, bench: DecodeBench, progress: bool = True, checkpoint=None) -> dict:
    """Measure every method of ``bench`` on ``model`` (eval mode, on its device).

    Returns
    -------
    The JSON document: ``decode_ms_per_token`` (per step of the batch), ``decode_tokens_per_s``
    (batch / step), ``cache_bytes``, ``peak_cache_bytes``, ``prefill_tokens_per_s`` (all
    sequences' tokens) ({method: {length: value}}, None where skipped), ``floor_ms_per_token``, ``threads``,
    ``device``, and the generation curve (a) under ``gen``, peak memory under ``peak``,
    skipped points under ``skipped``, and the settings. ``checkpoint`` (optional) is called
    with the partial result after every measured point, so a long run that is stopped keeps
    what it measured.
    """
    from tqdm.auto import tqdm

    config = model.config.get_text_config(decoder=True)
    old_limit = _extend_positions(model, bench.positions_needed())
    session = Session(model, bench)
    for method in bench.methods:
        session.cache(method, 1)  # a bad budget or option fails now, before any timing
    decode_steps = bench.warmup + bench.repeats
    runs = [(m, n) for m in bench.methods for n in bench.lengths]
    work = bench.floor_context + decode_steps
    work += len(bench.methods) * (bench.floor_context + max(bench.gen_lengths))
    work += sum(
        n + decode_steps + 4 * bench.repeats for m, n in runs if not bench.skips(m, n)
    )  # (at most: paired steps)
    bar = tqdm(total=work, unit="tok", desc="bench decode", disable=not progress, file=sys.stderr, dynamic_ncols=True)

    empty = lambda: {m: {} for m in bench.methods}  # noqa: E731
    result = {
        "decode_ms_per_token": empty(),
        # the mean of the same steps: with --repeats >= ARM's sync it counts the steps that write
        "decode_mean_ms_per_token": empty(),
        "decode_tokens_per_s": empty(),  # batch x steps / time, from the median step
        "floor_ms_per_token": None,
        "cache_bytes": empty(),
        "peak_cache_bytes": empty(),  # the largest the cache was during prefill and decode
        "prefill_tokens_per_s": empty(),
        # further steps with each layer's attention timed apart (Session.attention): its median
        # ms a step, summed over the layers, within it ARM's reads of its memory, and the share
        # of the memory those reads touched
        "attention_ms_per_token": empty(),
        "read_ms_per_token": empty(),
        "read_share": empty(),
        # where ARM reads sparsely (M < N_b): further steps each making ARM's reads and the dense
        # read of every slot of the same state, one after the other, the first in turn
        # (Session._paired_reads): each read's median a step where it ran first, and dense / sparse
        "paired_read_ms_per_token": empty(),
        "dense_read_ms_per_token": empty(),
        "dense_read_ratio": empty(),
        "threads": torch.get_num_threads(),
        "device": str(session.device),
        "gen": {"decode_ms_per_token": empty(), "cache_bytes": empty()},
        "peak": {"rss_bytes": empty(), "cuda_allocated_bytes": empty() if session.device.type == "cuda" else None},
        "skipped": {m: [] for m in bench.methods},
        "filled": {m: [] for m in bench.methods},  # random KV instead of a prefill (--beyond-full fill)
        "settings": {
            "model": getattr(config, "_name_or_path", "") or type(model).__name__,
            "dtype": str(model.dtype).removeprefix("torch."),
            "budget": bench.budget,
            "chunk": bench.chunk,
            "compile": bench.compile,
            "repeats": bench.repeats,
            "warmup": bench.warmup,
            "floor_context": bench.floor_context,
            "max_full_length": bench.max_full_length,
            "beyond_full": bench.beyond_full,
            "clock": bench.clock,
            "options": bench.options,
            "batch": bench.batch,
            "native_cache": bench.native_option("cache") if NATIVE in bench.methods else None,
            "native_chunk": bench.native_option("chunk") if NATIVE in bench.methods else None,
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "prompt": bench.prompt_name,
        },
    }
    try:
        with torch.inference_mode():
            # (d) the floor: a few tokens of context, the full cache
            bar.set_postfix_str("floor")
            cache = session.cache("full")
            token, _ = session.prefill(cache, bench.floor_context, bar.update)
            times, _ = session.decode(cache, token, bench.floor_context, decode_steps, bar.update)
            result["floor_ms_per_token"] = _median_ms(times[bench.warmup :])
            del cache

            # (a) against generation length: one decode from a few-token prompt per method
            for method in bench.methods:
                bar.set_postfix_str(f"{method} generation")
                cache = session.cache(method, bench.floor_context + max(bench.gen_lengths) + 1)
                token, _ = session.prefill(cache, bench.floor_context, bar.update)
                done: list[float] = []
                for g in bench.gen_lengths:
                    start = bench.floor_context + len(done)
                    times, token = session.decode(cache, token, start, g - len(done), bar.update)
                    done += times
                    # every step since the previous point (at least `repeats`), warm-up excluded
                    window = done[max(bench.warmup, min(start - bench.floor_context, len(done) - bench.repeats)) :]
                    window = window or done[-1:]
                    result["gen"]["decode_ms_per_token"][method][g] = _median_ms(window)
                    result["gen"]["cache_bytes"][method][g] = cache_state_bytes(cache)
                del cache
                gc.collect()
                if checkpoint is not None:
                    checkpoint(result)

            # (b), (c) against prompt length
            for method, length in runs:
                if bench.skips(method, length):
                    result["skipped"][method].append(length)
                    for key in POINT_KEYS:
                        result[key][method][length] = None
                    continue
                bar.set_postfix_str(f"{method} {length}")
                # the previous point's cache must be gone (and its pages returned to the
                # system) before the peak mark is reset, or this point inherits its peak
                cache = token = None
                gc.collect()
                _release_freed_memory()
                _reset_peak_rss()
                _device_peak_reset(session.device)
                cache = session.cache(method, length + decode_steps)
                if bench.fills(method, length):
                    result["filled"][method].append(length)
                    token = session.fill(cache, length, bar.update)
                    result["prefill_tokens_per_s"][method][length] = None
                else:
                    chunk = session.prefill_chunk(method, length)
                    token, seconds = session.prefill(cache, length, bar.update, chunk=chunk)
                    result["prefill_tokens_per_s"][method][length] = bench.batch * length / seconds
                result["cache_bytes"][method][length] = cache_state_bytes(cache)
                times, token = session.decode(cache, token, length, decode_steps, bar.update)
                median_ms = _median_ms(times[bench.warmup :])
                result["decode_ms_per_token"][method][length] = median_ms
                result["decode_mean_ms_per_token"][method][length] = statistics.mean(times[bench.warmup :]) * 1e3
                result["decode_tokens_per_s"][method][length] = bench.batch * 1e3 / median_ms
                result["peak_cache_bytes"][method][length] = cache_peak_bytes(cache)
                attention, reads, share, token, paired = session.attention(
                    cache, token, length + decode_steps, bench.repeats, bar.update
                )
                result["attention_ms_per_token"][method][length] = None if attention is None else attention * 1e3
                result["read_ms_per_token"][method][length] = None if reads is None else reads * 1e3
                result["read_share"][method][length] = share
                for key, value in zip(("paired_read_ms_per_token", "dense_read_ms_per_token"), paired[:2]):
                    result[key][method][length] = None if value is None else value * 1e3
                result["dense_read_ratio"][method][length] = paired[2]
                result["peak"]["rss_bytes"][method][length] = _peak_rss()
                if result["peak"]["cuda_allocated_bytes"] is not None:
                    result["peak"]["cuda_allocated_bytes"][method][length] = _device_peak(session.device)
                del cache, token
                if checkpoint is not None:
                    checkpoint(result)
    finally:
        config.max_position_embeddings = old_limit
        bar.close()
    result["int4_read"] = describe_int4_read()  # ARM's slot read: the fused CPU kernel or PyTorch ops
    return result


# ---------------------------------------------------------------------- reporting
def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value / scale:,.{digits}f}"


def _get(table: dict, method: str, length) -> float | None:
    row = table.get(method, {})
    return row.get(length, row.get(str(length)))


def _lengths(table: dict) -> list[int]:
    return sorted({int(n) for row in table.values() for n in row})


def summary(result: dict) -> list[str]:
    """One line per bounded method: its latency growth from the shortest to the longest prompt,
    against the floor, and against the full cache at the longest length both have."""
    lines = []
    floor = result["floor_ms_per_token"]
    decode, cache = result["decode_ms_per_token"], result["cache_bytes"]
    lengths = _lengths(decode)
    for method in decode:
        if method == "full":
            continue
        have = [n for n in lengths if _get(decode, method, n) is not None]
        if not have:
            continue
        lo, hi = have[0], have[-1]
        ms_lo, ms_hi = _get(decode, method, lo), _get(decode, method, hi)
        parts = [f"{method}: {ms_hi:.1f} ms/token at {hi} = {ms_hi / ms_lo:.2f}x its {lo}"]
        if floor:
            parts.append(f"{ms_hi / floor:.2f}x the floor")
        full_at = [n for n in have if "full" in decode and _get(decode, "full", n) is not None]
        if full_at:
            n = full_at[-1]
            speed = _get(decode, "full", n) / _get(decode, method, n)
            mem = _get(cache, "full", n) / max(_get(cache, method, n), 1)
            parts.append(f"{speed:.2f}x faster than full at {n} with {mem:.1f}x less cache")
        sizes = {_get(cache, method, n) for n in have}
        parts.append("cache bytes identical at every length" if len(sizes) == 1 else "cache bytes VARY with length")
        lines.append("- " + ", ".join(parts))
    return lines


def markdown(result: dict) -> str:
    """The result as markdown tables (prompt-length tables, the generation curve, the floor)."""
    out = []
    s = result["settings"]
    out.append(
        f"model {s['model']} ({s['dtype']}), budget {s['budget']}, chunk {s['chunk']}, device {result['device']}, "
        f"{result['threads']} torch threads; prompts: {s.get('prompt', 'random ids')}; "
        f"medians of {s['repeats']} steps after {s['warmup']} warm-up steps, "
        f"{s.get('clock', 'wall')} clock"
        + (f"; int4 slot read: {result['int4_read']}" if result.get("int4_read") else "")
        + "".join(f"; {m} options: {json.dumps(o)}" for m, o in (s.get("options") or {}).items())
        + (f"; batch {s['batch']} (ms per step of all sequences)" if s.get("batch", 1) > 1 else "")
        + (
            f"; native: transformers' {s['native_cache']} cache, prompt in "
            + (f"chunks of {s['native_chunk']}" if s.get("native_chunk") else "one forward")
            if s.get("native_cache")
            else ""
        )
    )
    out.append("")
    out.append(f"Floor (full cache, {s['floor_context']}-token context): {result['floor_ms_per_token']:.2f} ms/token")

    def table(title: str, data: dict, scale: float, digits: int, unit: str) -> None:
        lengths = _lengths(data)
        if not lengths:
            return
        out.append("")
        out.append(f"{title} ({unit})")
        out.append("")
        out.append("| method | " + " | ".join(str(n) for n in lengths) + " |")
        out.append("|---|" + "---:|" * len(lengths))
        for method in data:
            cells = [
                _fmt(_get(data, method, n), scale, digits) if n in {int(k) for k in data[method]} else ""
                for n in lengths
            ]
            out.append(f"| {method} | " + " | ".join(cells) + " |")

    table("Decode latency against prompt length", result["decode_ms_per_token"], 1.0, 1, "ms/token")
    if result.get("decode_mean_ms_per_token"):
        table(
            "Decode latency against prompt length, mean of the same steps",
            result["decode_mean_ms_per_token"],
            1.0,
            1,
            "ms/token",
        )
    if result.get("decode_tokens_per_s"):
        table(
            "Decode throughput, all sequences, from the median step", result["decode_tokens_per_s"], 1.0, 1, "tokens/s"
        )
    if any(v is not None for row in result.get("attention_ms_per_token", {}).values() for v in row.values()):
        table(
            "Attention inside the cache, all layers, further steps timed apart",
            result["attention_ms_per_token"],
            1.0,
            1,
            "ms/token",
        )
    if any(v is not None for row in result.get("read_ms_per_token", {}).values() for v in row.values()):
        table("ARM's reads of its memory, within that attention", result["read_ms_per_token"], 1.0, 1, "ms/token")
    if any(v is not None for row in result.get("read_share", {}).values() for v in row.values()):
        table("Share of ARM's occupied slots a decode read touches", result["read_share"], 0.01, 1, "%")
    if any(v is not None for row in result.get("dense_read_ratio", {}).values() for v in row.values()):
        table(
            "ARM's sparse reads, in steps that make each beside the dense read of the same state (timed where it "
            "runs first)",
            result["paired_read_ms_per_token"],
            1.0,
            1,
            "ms/token",
        )
        table(
            "The dense reads of every slot of those states (timed where they run first)",
            result["dense_read_ms_per_token"],
            1.0,
            1,
            "ms/token",
        )
        table("Dense read / sparse read, of those medians", result["dense_read_ratio"], 1.0, 2, "x")
    table("Cache bytes after the prompt", result["cache_bytes"], 2**20, 2, "MiB")
    if result.get("peak_cache_bytes"):
        table("Peak cache bytes during prefill and decode", result["peak_cache_bytes"], 2**20, 2, "MiB")
    table(
        "Prefill throughput, all sequences, chunks of P (native: as in the header)",
        result["prefill_tokens_per_s"],
        1.0,
        0,
        "tokens/s",
    )
    gen = result["gen"]
    table("Decode latency against generation length", gen["decode_ms_per_token"], 1.0, 1, "ms/token")
    table("Cache bytes against generation length", gen["cache_bytes"], 2**20, 2, "MiB")
    if any(result["peak"]["rss_bytes"].values()):
        table("Peak process RSS during prefill + decode", result["peak"]["rss_bytes"], 2**20, 0, "MiB")
    if result["peak"]["cuda_allocated_bytes"] is not None:
        table("Peak torch.cuda.max_memory_allocated", result["peak"]["cuda_allocated_bytes"], 2**20, 0, "MiB")
    skipped = {m: n for m, n in result["skipped"].items() if n}
    if skipped:
        out.append("")
        limit = s["max_full_length"]
        for method, lengths in skipped.items():
            out.append(f"- {method} skipped at {', '.join(map(str, lengths))} (--max-full-length {limit})")
    filled = {m: n for m, n in result.get("filled", {}).items() if n}
    if filled:
        out.append("")
        limit = s["max_full_length"]
        for method, lengths in filled.items():
            out.append(
                f"- {method} at {', '.join(map(str, lengths))}: cache filled with random keys and values instead of a "
                f"prefill (--max-full-length {limit} --beyond-full fill): decode and bytes measured, prefill not"
            )
    lines = summary(result)
    if lines:
        out.append("")
        out.extend(lines)
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    """Log-scale panels as in the paper's figure 3: cache bytes and latency against generation
    length; latency (with the floor), cache bytes and prefill throughput against prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    panels = [
        (axes[0, 0], result["gen"]["cache_bytes"], 2**20, "generation length (tokens)", "cache (MiB)"),
        (axes[0, 1], result["gen"]["decode_ms_per_token"], 1.0, "generation length (tokens)", "decode (ms/token)"),
        (axes[1, 0], result["cache_bytes"], 2**20, "prompt length (tokens)", "cache (MiB)"),
        (axes[1, 1], result["decode_ms_per_token"], 1.0, "prompt length (tokens)", "decode (ms/token)"),
        (axes[1, 2], result["prefill_tokens_per_s"], 1.0, "prompt length (tokens)", "prefill (tokens/s)"),
    ]
    for ax, data, scale, xlabel, ylabel in panels:
        for method, row in data.items():
            points = sorted((int(n), v / scale) for n, v in row.items() if v is not None)
            if points:
                ax.plot(*zip(*points), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    floor = result["floor_ms_per_token"]
    if floor:
        for ax in (axes[0, 1], axes[1, 1]):
            ax.axhline(floor, color="black", linestyle="--", linewidth=1, label="floor")
    for ax, _, _, _, _ in panels:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    s = result["settings"]
    axes[0, 2].axis("off")
    axes[0, 2].text(
        0.0,
        0.9,
        f"{Path(str(s['model'])).name}\n{s['dtype']}, budget {s['budget']}, chunk {s['chunk']}\n"
        f"{result['device']}, {result['threads']} torch thread(s)\nmedian of {s['repeats']} steps, "
        f"{s.get('clock', 'wall')} clock",
        va="top",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_results(docs: list[dict]) -> dict:
    """One document from runs split by method or length (same model, device, threads, clock).

    Points are united (a later document wins a point both measured); the floor is the median
    of the runs' floors, each kept under ``floor_runs``.
    """
    if not docs:
        raise ArmkvError("--merge needs at least one results.json")
    same = ("model", "dtype", "budget", "chunk", "clock", "options", "batch")
    first = docs[0]
    for doc in docs[1:]:
        for key in ("threads", "device"):
            if doc[key] != first[key]:
                raise ArmkvError(f"--merge: runs differ in {key} ({first[key]} vs {doc[key]}); merge like with like")
        for key in same:
            empty = {"options": {}, "batch": 1}.get(key)  # runs from before --option, --batch recorded none
            if doc["settings"].get(key, empty) != first["settings"].get(key, empty):
                raise ArmkvError(f"--merge: runs differ in {key}; merge like with like")
    merged = json.loads(json.dumps(first))

    def unite(target: dict, source: dict) -> None:
        for method, row in source.items():
            target.setdefault(method, {}).update(row)

    for doc in docs[1:]:
        for key in POINT_KEYS:
            if key in doc:  # runs from before a key was recorded have none
                unite(merged.setdefault(key, {}), doc[key])
        for key in ("decode_ms_per_token", "cache_bytes"):
            unite(merged["gen"][key], doc["gen"][key])
        unite(merged["peak"]["rss_bytes"], doc["peak"]["rss_bytes"])
        if merged["peak"].get("cuda_allocated_bytes") is not None:
            unite(merged["peak"]["cuda_allocated_bytes"], doc["peak"]["cuda_allocated_bytes"] or {})
        for key in ("skipped", "filled"):
            for method, lengths in doc.get(key, {}).items():
                merged.setdefault(key, {}).setdefault(method, [])
                merged[key][method] = sorted(set(merged[key][method]) | set(lengths))
        if doc["settings"].get("max_full_length") is not None:
            merged["settings"]["max_full_length"] = doc["settings"]["max_full_length"]
    # a point another run measured is no longer skipped, and one it prefilled no longer filled
    for method, lengths in merged.get("skipped", {}).items():
        merged["skipped"][method] = [n for n in lengths if _get(merged["decode_ms_per_token"], method, n) is None]
    for method, lengths in merged.get("filled", {}).items():
        merged["filled"][method] = [n for n in lengths if _get(merged["prefill_tokens_per_s"], method, n) is None]
    floors = [d["floor_ms_per_token"] for d in docs if d["floor_ms_per_token"] is not None]
    merged["floor_ms_per_token"] = statistics.median(floors) if floors else None
    merged["floor_runs"] = floors
    return merged


# ---------------------------------------------------------------------- command line
def int_list(text: str, what: str) -> list[int]:
    """'1024,2k,4096' -> [1024, 2048, 4096]; a one-line error on anything else."""
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1024 if part.endswith("k") else 1
        try:
            values.append(int(part.removesuffix("k")) * scale)
        except ValueError:
            raise ArmkvError(f"{what} {text!r}: expected comma-separated integers such as 1024,2048 or 1k,2k") from None
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--methods", default=DEFAULT_METHODS, help=f"comma-separated cache methods (default {DEFAULT_METHODS})"
    )
    parser.add_argument("--budget", type=int, default=512, help="token-equivalents of KV per layer (default 512)")
    parser.add_argument(
        "--lengths", default=DEFAULT_LENGTHS, help=f"prompt lengths of (b), (c) (default {DEFAULT_LENGTHS})"
    )
    parser.add_argument(
        "--gen-lengths", default=DEFAULT_GEN_LENGTHS, help=f"generation lengths of (a) (default {DEFAULT_GEN_LENGTHS})"
    )
    parser.add_argument(
        "--model", default=None, help="a local transformers model folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--model-config",
        default=None,
        metavar="NAME|CONFIG_JSON",
        help="instead of --model: a random-weight model of a shipped shape (llama-3.1-8b, llama-3.2-1b, "
        "qwen3-8b, mistral-7b, smollm2-135m: the default model's) or of a config.json, made on --device in --dtype "
        "from --seed",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences decoded together; latency is per step, throughput batch/step (default 1)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=16,
        help="timed decode steps per point; the median is reported and the mean beside it, which counts "
        "ARM's write when this is at least its sync (default 16, the sync at budget 512)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them (default 2)")
    parser.add_argument("--chunk", type=int, default=256, help="P, the prefill chunk: tokens per forward (default 256)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="bounded methods decode through their torch.compile'd step (the warm-up steps compile it)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="the model's dtype"
    )
    parser.add_argument(
        "--max-full-length",
        type=int,
        default=None,
        help="skip unbounded methods (full, offload) at prompt lengths beyond this, noted in the table",
    )
    parser.add_argument(
        "--beyond-full",
        choices=("skip", "fill"),
        default="skip",
        help="past --max-full-length: skip the point, or fill the full cache with random KV and time its decode only",
    )
    parser.add_argument(
        "--max-length", type=int, default=131072, help="refuse prompt lengths beyond this (default 131072)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="wall time, or the process's CPU time (on a CPU shared with other jobs)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--prompt-file",
        default=None,
        metavar="TXT",
        help="prompts from this text's tokens (the model's tokenizer; repeated to each length) instead "
        "of random ids: what a sparse read (M < N_b) touches depends on the text",
    )
    parser.add_argument(
        "--adapter", default=None, help="arm and fifo: ARM parameters, a folder, 'calibrated' (the default) or 'random'"
    )
    parser.add_argument(
        "--option",
        action="append",
        metavar="METHOD.KEY=VALUE",
        help="a method option (repeatable), as the evals take it: arm.sync=32, kivi.bits=2; the native "
        "row takes native.cache=dynamic|static and native.chunk=N (default: the prompt in one forward)",
    )
    parser.add_argument("--output", default=None, help="folder for results.json, table.md and decode.png")
    parser.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="RESULTS_JSON",
        default=None,
        help="measure nothing: merge these runs' results.json into one table, plot and JSON",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def bench_from_args(args) -> DecodeBench:
    from armkv.options import parse_options, with_adapter  # the evals' --option syntax, METHOD.KEY=VALUE

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    prompt = {}
    if getattr(args, "prompt_file", None) is not None:
        if args.model_config is not None:
            raise ArmkvError(
                "--prompt-file needs a model with a tokenizer: give --model (or neither), not --model-config"
            )
        if not Path(args.prompt_file).is_file():
            raise ArmkvError(f"--prompt-file {args.prompt_file}: no such file")
        prompt = {"prompt_ids": prompt_tokens(args.prompt_file, args.model), "prompt_name": Path(args.prompt_file).name}

    return DecodeBench(
        methods=methods,
        lengths=int_list(args.lengths, "--lengths"),
        gen_lengths=int_list(args.gen_lengths, "--gen-lengths"),
        budget=args.budget,
        chunk=args.chunk,
        repeats=args.repeats,
        warmup=args.warmup,
        max_full_length=args.max_full_length,
        beyond_full=args.beyond_full,
        max_length=args.max_length,
        clock=args.clock,
        seed=args.seed,
        options=with_adapter(parse_options(args.option), getattr(args, "adapter", None), methods),
        batch=args.batch,
        compile=args.compile,
        **prompt,
    )


def prompt_tokens(path: str, model_dir: str | None) -> list[int]:
    """The tokens of the text at ``path`` under the tokenizer of the model folder (default:
    the packaged model's)."""
    from armkv.hf.compat import transformers
    from armkv.hf.model import default_model_dir

    folder = default_model_dir() if model_dir is None else Path(model_dir)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ArmkvError(
            f"--prompt-file needs the model's tokenizer, and {folder} has none ({type(e).__name__})"
        ) from None
    return tokenizer(Path(path).read_text(errors="replace"), add_special_tokens=False).input_ids


def load_bench_model(model_dir: str | None, device: str, dtype: str):
    """The model alone (random ids need no tokenizer): a local folder, or the default model."""
    from armkv.hf.compat import transformers
    from armkv.hf.model import default_model_dir

    if device == "cuda" and not torch.cuda.is_available():
        raise ArmkvError("--device cuda: torch sees no CUDA device here; use --device cpu")
    path = default_model_dir() if model_dir is None else Path(model_dir)
    if not (path / "config.json").is_file():
        raise ArmkvError(f"--model {path}: not a transformers model folder (no config.json)")
    # transformers' loading bar would sit between the progress bar and a one-line error
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, dtype), local_files_only=True
        )
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model.to(device).eval()


def build_bench_model(model_config: str, device: str, dtype: str, seed: int = 0):
    """A random-weight model of a shipped shape or a config.json, made on the device."""
    from armkv.hf.model import build_model_from_config, model_config_path

    if device == "cuda" and not torch.cuda.is_available():
        raise ArmkvError("--device cuda: torch sees no CUDA device here; use --device cpu")
    model_config_path(model_config)  # an unknown name fails before anything is built
    return build_model_from_config(model_config, getattr(torch, dtype), device, seed)


def cpu_session(length: int, budget: int = 512, method: str = "arm"):
    """The setup the measurement scripts share: one torch thread, the default model in fp32
    on the CPU, and a :class:`Session` for one method at one prompt length and budget, timed
    in process CPU time. Returns (model, session)."""
    torch.set_num_threads(1)
    model = load_bench_model(None, "cpu", "float32")
    return model, Session(model, DecodeBench(methods=[method], lengths=[length], budget=budget, clock="process"))


def report(result: dict, args) -> None:
    """Write results.json, table.md and decode.png under --output (if given); print the table
    (unless --json) and then the JSON line."""
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.partial.json").unlink(missing_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "table.md").write_text(markdown(result))
        plot(result, out / "decode.png")
    if not args.json:
        print(markdown(result))
    print(json.dumps(result))


def main(args) -> int:
    if args.merge:
        docs = []
        for name in args.merge:
            try:
                docs.append(json.loads(Path(name).read_text()))
            except (OSError, ValueError) as e:
                raise ArmkvError(f"--merge {name}: cannot read a results document ({e})") from None
        report(merge_results(docs), args)
        return 0
    bench = bench_from_args(args)
    if args.output:
        from armkv.tools.preflight import check_output_folder

        check_output_folder(args.output)
    if args.threads is not None:
        if args.threads < 1:
            raise ArmkvError(f"--threads {args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    if args.model_config is not None:
        if args.model is not None:
            raise ArmkvError("give --model (a folder with weights) or --model-config (random weights), not both")
        model = build_bench_model(args.model_config, args.device, args.dtype, args.seed)
    else:
        model = load_bench_model(args.model, args.device, args.dtype)
    out = Path(args.output) if args.output else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    def checkpoint(partial: dict) -> None:
        if out is not None:
            (out / "results.partial.json").write_text(json.dumps(partial, indent=1) + "\n")

    result = run_bench(model, bench, progress=not args.no_progress, checkpoint=checkpoint)
    if args.model is not None:
        result["settings"]["model"] = str(args.model)
    report(result, args)
    return 0
