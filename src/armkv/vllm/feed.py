"""How one request's tokens reach its armkv cache layer when an engine schedules them in
pieces (vLLM's chunked prefill, mixed batches, preemption): free of vLLM, so that the main
test suite checks it."""

from __future__ import annotations

import functools
import inspect

import torch

from armkv.errors import ArmkvError
from armkv.methods.base import CacheLayer


class RequestMemory:
    """One request's armkv cache layer in one attention layer, fed as the HF path feeds it.

    ``open``: the (query, key, value) [1, H, n, d] of the prompt chunk being filled (its first
    ``n`` tokens, read but not committed), None between chunks."""

    def __init__(self, layer: CacheLayer, chunk: int):
        self.layer, self.chunk = layer, chunk
        self.next = 0  # the position of the next token this request will be given
        self.open: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def step(self, q, k, v, start: int, prompt_len: int, scaling: float) -> torch.Tensor:
        """Attend the tokens at positions [start, start + T) (q [T, Hq, d], k, v [T, Hkv, d]),
        commit what the HF path would have committed by then; returns [T, Hq, d]."""
        if start != self.next:
            raise ArmkvError(f"ARM state out of step: given position {start}, expected {self.next}")
        T = q.shape[0]
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, d]
        if T == 1 and start >= prompt_len:  # a generated token (most calls): no chunk bookkeeping
            self.next = start + 1
            return self.generated(q4, k4, v4, start, scaling)
        outs, i, pos, P = [], 0, start, self.chunk
        n_prompt = max(0, min(T, prompt_len - start))
        while i < n_prompt:  # the prompt: chunks of P from position 0, the last one as it is
            chunk_start = pos - (0 if self.open is None else self.open[0].shape[2])
            chunk_end = min(chunk_start + P, prompt_len)
            take = min(n_prompt - i, chunk_end - pos)
            new = (q4[:, :, i : i + take], k4[:, :, i : i + take], v4[:, :, i : i + take])
            whole = new if self.open is None else tuple(torch.cat([a, b], 2) for a, b in zip(self.open, new))
            n = whole[0].shape[2]
            positions = torch.arange(chunk_start, chunk_start + n, device=q.device).unsqueeze(0)
            valid = torch.ones(1, n, dtype=torch.bool, device=q.device)
            if pos + take == chunk_end:
                out = self.layer.attend(*whole, valid, positions, scaling)
                self.open = None
            else:
                out = self.layer.peek_chunk(*whole, valid, positions, scaling)
                self.open = whole
            outs.append(out[0, n - take :])
            i, pos = i + take, pos + take
        for j in range(i, T):  # generated tokens (a request recomputed after preemption): one at a time
            outs.append(
                self.generated(q4[:, :, j : j + 1], k4[:, :, j : j + 1], v4[:, :, j : j + 1], start + j, scaling)
            )
        self.next = start + T
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def generated(self, q4, k4, v4, position: int, scaling: float) -> torch.Tensor:
        """Attend and commit one generated token (q4, k4, v4 [1, H, 1, d]); returns [1, Hq, d]."""
        positions = torch.full((1, 1), position, dtype=torch.long, device=q4.device)
        one = torch.ones(1, 1, dtype=torch.bool, device=q4.device)
        return self.layer.attend(q4, k4, v4, one, positions, scaling)[0]


def held_tensors(memory: RequestMemory) -> dict[str, torch.Tensor]:
    """Every tensor a request's memory keeps (by its attribute path), not counting what all
    requests share (the ARM parameters, the rotary table, the cached mixing matrix): what must
    lie in the request's block when the engine owns its memory."""
    from armkv.memory.quant import mixing_matrix

    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj, path: str) -> None:
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 2 and obj.shape[0] == obj.shape[1]:
                shared = mixing_matrix(obj.shape[0], obj.dtype, obj.device)
                if obj.data_ptr() == shared.data_ptr():
                    return
            found[path] = obj
        elif isinstance(obj, (torch.nn.Module, torch.Generator, torch.device, type)) or inspect.isroutine(obj):
            return
        elif isinstance(obj, functools.partial):
            walk((obj.args, obj.keywords), f"{path}.partial")
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        elif hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                if k not in ("rotary", "info", "config", "rule", "memory"):
                    walk(v, f"{path}.{k}")

    walk(memory, "memory")
    return found
