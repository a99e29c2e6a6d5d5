"""Fused CPU kernels for ARM's decode step (``csrc/``: one extension built from its sources by
concern, listed in ``csrc/common.h``): the read of int4 slots, and the passes over the pool that
a write makes. They are the ``cpu`` backend of the reads (``armkv.memory.reader.BACKENDS``).

The decode step reads every slot of a layer: its keys against the new query, its values
under the softmax weights. :meth:`MemoryState.key_scores` and
:meth:`MemoryState.weighted_values` do it in PyTorch (the reference, and the path for
GPUs, gradients and other dtypes); on a CPU the eager ops split the nibbles, convert them to
floats and multiply, a dozen passes over the state. The kernel reads each byte once and
decodes it in registers (AVX2 where the CPU has it, plain loops elsewhere).

Every kernel serves float32 tensors on a CPU with no gradient wanted, outside
``torch.compile``; any other dtype (bfloat16, float16) or device (CUDA), a gradient, or a
compiled graph takes the PyTorch reference instead.

It is compiled with ``torch.utils.cpp_extension`` on first use (a C++ compiler is needed;
about a minute, once per machine and source version, kept in torch's extension cache).
Where it cannot be built, a warning says why, once, and the PyTorch path serves.
``ARMKV_KERNELS=0`` skips it.

At M < N_b (``top_m="fixed"``, or a fitted policy) the decode step reads only the slots of
each KV head's top-M buckets (``Reader.sparse``). With PyTorch ops that is a dozen
small ops to route the query, list the buckets' slots, gather them by index from the
channel-major codes and read the copy: at budget 2,048 they cost two thirds of reading the
whole pool. ``arm_best_decode_read`` does it for ``read_rank="best"`` in one call: every
slot scored once (one pass over the key codes), each bucket ranked by its best logit, and the
chosen buckets' slots read with the logits already computed (only their values are read
again). ``arm_partial_decode_read`` does it for ``read_rank="partial"``: each slot scored over
only the few key-code rows where the query is largest (one pass over those rows), each bucket
ranked by its best partial logit, and the chosen buckets' slots read whole. For ``"tree"``,
``group_leaf_topm`` routes the query down the tree (un-rotated inside) and
``arm_sparse_decode_read`` reads the chosen buckets where they lie:
a pool laid bucket by bucket (``read.sort_by_bucket``) makes each bucket one run of slots,
copied out a row at a time and read as ``arm_decode_read`` reads a pool. Their references are
``read.bucket_best`` of the PyTorch logits (for ``"partial"``, of
``MemoryState.partial_key_scores``), ``Router.group_topm_buckets`` and ``read.gathered_read``.

A prefill chunk at M < N_b (``read_rank="best"`` or ``"partial"``) computes every slot's
logit for its queries with one batched product; ``ranked_slot_read`` then ranks each query's
buckets (or pages) from those logits and sums only the chosen slots' values under their
softmax weights, where the PyTorch form (``read.ranked_chunk_read`` without ``fused``, its
reference) masks the logits, softmaxes them all and multiplies by every slot's value.
``bucket_lists`` builds a pool's bucket index (``read.bucket_index``) by a counting sort.

The write (``SlotPool.write``, every ``sync`` decoded tokens) un-packs the whole pool to
pre-RoPE floats and, once the pool is full, finds each slot's nearest neighbour in a band
of the bucket order (``write.banded_neighbours``): with PyTorch ops about 30 passes over
the state, 20-50 ms per write in a layer of 3k-7k slots. ``int4_unpack_pre_rope`` and
``band_neighbours`` make one pass each; the PyTorch forms stay as their references.

A prefill chunk's write plan (``write.plan_writes``), once a pool is short of room, scores
every token of the chunk against every slot and takes, per token, the best occupied slot
of its bucket (the merge candidate) and of any bucket (where a demoted token goes): with
PyTorch ops eight passes over the [tokens, slots] scores (the affine map, the bucket and
occupancy masks, two masked maxima). ``best_slots`` takes both maxima in one pass over the
cosines.

The decode step also pushes its token into the exact window (``ExactBuffer._push_one``):
some twenty small PyTorch ops per layer, each dispatched from Python; ``ring_push`` does
it in one call on a CPU (the ops stay as its reference, ``ExactBuffer.fused_push``).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

_CSRC = Path(__file__).parent / "csrc"
# the sources by concern (csrc/common.h lists them), built as one extension
_SOURCES = sorted(_CSRC.glob("*.cpp"))
# the build is named by the hash of every source and header and of the torch it builds
# against: two versions of armkv (an upgrade, two checkouts on one machine) build into their own
# folders of torch's extension cache and never load each other's module, whose functions may
# take other arguments; and two environments (armkv's and vLLM's, docs/serving.md) do not take
# turns rebuilding one folder (torch rebuilds when the build's include paths change)


def build_name(csrc: Path, torch_version: str, torch_dir: str) -> str:
    """The extension's name: a hash of every source and header and of the torch it builds against."""
    digest = hashlib.sha256()
    for path in sorted(csrc.glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(f"{torch_version}\0{torch_dir}".encode())
    return "armkv_kernels_" + digest.hexdigest()[:12]


_NAME = build_name(_CSRC, torch.__version__, str(Path(torch.__file__).parent))
_lock = threading.Lock()
_module = None
_tried = False


def enabled() -> bool:
    """Whether the fused kernels may be used (``ARMKV_KERNELS`` unset or not 0/false/off/no),
    and not while ``torch.compile`` traces: a compiled graph cannot call the extension, so
    a compiled decode step takes the PyTorch references."""
    if torch.compiler.is_compiling():
        return False
    return os.environ.get("ARMKV_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")


def int4_read():
    """The built extension module, or None (turned off, or the build failed: warned once)."""
    global _module, _tried
    if not enabled():
        return None
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            from torch.utils.cpp_extension import _get_build_directory, load

            build = Path(_get_build_directory(_NAME, verbose=False))
            _wait_for_lock(build / "lock")
            if not any(build.glob(f"{_NAME}*.so")):
                print("armkv: building the fused int4 read kernel (once per machine, about a minute)", file=sys.stderr)
            _module = load(
                name=_NAME,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-std=c++17"],
                extra_include_paths=[str(_CSRC)],
                verbose=False,
            )
        except Exception as e:  # no compiler, no headers, a failed build: the PyTorch path serves
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(
                f"armkv: the fused int4 read kernel could not be built ({why}); reading slots with PyTorch "
                "ops instead (slower on CPU). Set ARMKV_KERNELS=0 to skip the attempt.",
                RuntimeWarning,
                stacklevel=2,
            )
        return _module


STALE_LOCK_S = 600  # a build takes a minute or a few: a lock this old was left by a process killed mid-build


def _wait_for_lock(lock: Path, poll_s: float = 1.0) -> None:
    """torch's build lock, left behind by a process killed while it built or loaded the kernel
    (an engine that stops a slow step, a Ctrl-C), makes every later load wait forever without a
    word. Wait here instead while another process may be building (saying so once), and remove a
    lock older than STALE_LOCK_S with a warning that names it."""
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            warnings.warn(
                f"armkv: removed {lock}, a kernel build lock {age / 60:.0f} minutes old (left by a process "
                "stopped while it built or loaded the kernel)",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        if not said:
            print(
                f"armkv: waiting for another process's kernel build ({lock}; removed if it is still there "
                f"{STALE_LOCK_S // 60} minutes after it was made)",
                file=sys.stderr,
            )
            said = True
        time.sleep(poll_s)


def describe() -> str:
    """How int4 slots have been read in this process, for benchmark reports: "fused kernel",
    "pytorch" (off, not built, or not a CPU read) or "unused" (no int4 CPU read yet)."""
    if not enabled():
        return "pytorch (ARMKV_KERNELS=0)"
    if _module is not None:
        return "fused kernel"
    return "pytorch (kernel not built)" if _tried else "unused"


def fused_read(x: torch.Tensor, codes: torch.Tensor, int8: bool = False):
    """The kernel module where it serves this read, else None: int4 codes (uint8; with
    ``int8`` also int8 codes: the key scores of k8v4 and int8 slots), float32 queries or
    weights on the CPU, and no gradient wanted."""
    if (
        codes.dtype not in ((torch.uint8, torch.int8) if int8 else (torch.uint8,))
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or codes.device.type != "cpu"
    ):
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    return int4_read()


def fused_cpu(x: torch.Tensor):
    """The kernel module where it serves an operation on ``x``: float32 on the CPU with no
    gradient wanted (the writes' kernels), else None."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return None
    return int4_read()
