"""Experiment: how well a cache keeps a RULER needle, measured as the teacher-forced NLL of
the answer (lower is better; a continuous score with far less sampling noise than 0/100).

For each sample the context is prefilled through the cache (the budgeted chunked protocol),
then question + answer prefix + the answer are fed in one forward, and the mean NLL of the
answer's tokens is read; ``em`` says whether every answer token was the argmax. For ARM it
also prints the share of the needle's tokens (the value and the 20 tokens before it) still
held exactly in each layer after the prefill.

Configs are ``METHOD[:KEY=VALUE,...]`` separated by ``;``; the keys are the method's options
(e.g. ``arm:slot_format=model``) plus three experiment switches that patch ARM's internals
for this process only:

- ``protect=true``: an oracle; the needle's tokens are never merged (tells what the write
  policy loses from what the read loses);
- ``local=L``: merge scores minus L * |distance in positions| / 256 (merges kept local);
- ``exact_nn=S``: pools up to S slots search nearest neighbours exactly (S x S);
- ``protect=all``: the oracle keeps every needle of the context (multi-needle tasks: the
  distractors too);
- ``protect_layers=A-B``: with ``protect=true``, the oracle holds only in layers A to B
  (which layers need the needle kept).

    python scripts/needle_nll.py --task niah_single_2 --length 2048 --samples 3 \\
        --haystack heldout.txt --configs "full;arm;arm:slot_format=model;arm:protect=true"

``--all-answers`` scores every answer of a multi-answer task (multiquery, multivalue),
teacher-forced as the numbered list the model writes; the exact shares stay the first answer's.

(``python -m armkv.train.data heldout heldout.txt`` writes the held-out prose used in docs/memory.md.)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import torch

import armkv.memory.module as arm_module
import armkv.memory.write as arm_write
from armkv.options import option_value
from armkv.evals.ruler import RulerGenerator, load_essay
from armkv.hf.attach import make_cache
from armkv.hf.model import load_model
from armkv.hf.runner import Runner

PATCH = {"needle": None, "local": 0.0, "pos": None, "layers": None, "seen": {}, "layer": 0}
_room_similarity = arm_write.room_similarity
_write = arm_module.ARMMemory.write


def _in_needle(pos: torch.Tensor) -> torch.Tensor:
    """True where a position lies in a protected span (PATCH["needle"]: a list of (lo, hi))."""
    hit = torch.zeros_like(pos, dtype=torch.bool)
    for lo, hi in PATCH["needle"]:
        hit |= (pos >= lo) & (pos < hi)
    return hit


def _protecting() -> bool:
    layers = PATCH["layers"]
    return PATCH["needle"] is not None and (layers is None or layers[0] <= PATCH["layer"] <= layers[1])


def _patched_room_similarity(metric, state, keys, values, cos, slot_pairs=True):
    ss, ts = _room_similarity(metric, state, keys, values, cos, slot_pairs)
    tok = PATCH["pos"]
    if PATCH["local"]:
        lam, sp = PATCH["local"], state.pos
        ss = None if ss is None else ss - lam * (sp.unsqueeze(2) - sp.unsqueeze(1)).abs() / 256
        ts = ts - lam * (tok.unsqueeze(2) - sp.unsqueeze(1)).abs() / 256
    if _protecting():
        slot = (state.count == 1) & _in_needle(state.pos)
        if ss is not None:
            ss = ss.masked_fill(slot.unsqueeze(1) | slot.unsqueeze(2), -math.inf)
        if ts is not None:  # None: the fused path scores tokens in _make_room (patched below)
            ts = ts.masked_fill(_in_needle(tok).unsqueeze(2) | slot.unsqueeze(1), -math.inf)
    return ss, ts


def _patched_make_room(state, leader, neighbours, token_sims, deficit, nearest_token=None):
    if _protecting() and nearest_token is not None:
        slot = (state.count == 1) & _in_needle(state.pos)
        sim, idx = nearest_token
        nearest_token = (sim.masked_fill(_in_needle(PATCH["pos"]) | slot.gather(1, idx), -math.inf), idx)
    return _make_room(state, leader, neighbours, token_sims, deficit, nearest_token)


def _patched_neighbours(metric, state, width=arm_write.BAND_WIDTH):
    sim, idx = _banded(metric, state, width)
    if _protecting():
        slot = (state.count == 1) & _in_needle(state.pos)
        sim = sim.masked_fill(slot | slot.gather(1, idx), -math.inf)
    return sim, idx


_banded = arm_write.banded_neighbours
_make_room = arm_write._make_room


def _patched_write(self, state, keys, values, positions, valid, generator=None, config=None, **kwargs):
    B, H, N, _ = keys.shape
    PATCH["layer"] = PATCH["seen"].setdefault(id(self), len(PATCH["seen"]))  # layers write in order
    PATCH["pos"] = positions.float().unsqueeze(1).expand(B, H, N).reshape(B * H, N)
    return _write(self, state, keys, values, positions, valid, generator, config, **kwargs)


arm_write.room_similarity = _patched_room_similarity
arm_write.banded_neighbours = _patched_neighbours
arm_write._make_room = _patched_make_room
arm_module.ARMMemory.write = _patched_write


def needle_spans(ctx: list[int], tok) -> list[tuple[int, int]]:
    """(lo, hi) token spans of every needle sentence ("... magic number(s) for KEY is: VALUE.")
    in the context: the 20 tokens before each value, the value and two after."""
    text = tok.decode(ctx)
    spans = []
    for m in re.finditer(r"special magic \w+ for [^.]*? is: (\S+?)\.", text):
        value = tok(" " + m.group(1), add_special_tokens=False)["input_ids"]
        at = find(ctx, value)
        if at is not None:
            spans.append((at - 20, at + len(value) + 2))
    return spans


def answer_target(tok, answers: list[str], every: bool) -> tuple[list[int], torch.Tensor]:
    """The teacher-forced continuation and a mask of the tokens scored: the first answer alone,
    or (``every``) all answers as the numbered list the model writes, scoring their tokens only."""
    if not every:
        ids = tok(" " + answers[0], add_special_tokens=False)["input_ids"]
        return ids, torch.ones(len(ids), dtype=torch.bool)
    ids = tok(":\n", add_special_tokens=False)["input_ids"]
    scored = [False] * len(ids)
    for i, answer in enumerate(answers):
        marker = tok(f"{chr(10) if i else ''}{i + 1}.", add_special_tokens=False)["input_ids"]
        value = tok(" " + answer, add_special_tokens=False)["input_ids"]
        ids += marker + value
        scored += [False] * len(marker) + [True] * len(value)
    return ids, torch.tensor(scored)


def find(ids: list[int], sub: list[int]) -> int | None:
    return next((i for i in range(len(ids) - len(sub) + 1) if ids[i : i + len(sub)] == sub), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="niah_single_2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--haystack", required=True, help="prose file for the essay haystack")
    p.add_argument("--haystack-kind", default="task", choices=("task", "noise", "essay"))
    p.add_argument("--configs", default="full;arm")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--indices", default="", help="only these of the --samples samples, e.g. 5,8 (the ones an eval missed)")
    p.add_argument("--all-answers", action="store_true", help="multi-answer tasks: score every answer, teacher-forced "
                   "as the numbered list the model writes (':\\n1. A\\n2. B ...'), NLL over the answers' tokens only")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_model(None)
    gen = RulerGenerator(tok, haystack_words=load_essay(a.haystack), haystack=None if a.haystack_kind == "task" else a.haystack_kind)
    samples = gen.samples(a.task, a.length, a.samples)
    if a.indices:
        samples = [samples[int(i)] for i in a.indices.split(",")]
    runner = Runner(model, tok, "full")
    for cfg in a.configs.split(";"):
        method, _, opts = cfg.partition(":")
        options = {}
        for kv in filter(None, opts.split(",")):
            k, v = kv.split("=")
            options[k] = option_value(v)
        protect, PATCH["local"] = options.pop("protect", False), float(options.pop("local", 0.0))
        arm_write.EXACT_NEIGHBOURS = int(options.pop("exact_nn", 640))
        layers = str(options.pop("protect_layers", ""))
        PATCH["layers"] = tuple(int(x) for x in layers.split("-")) if layers else None
        t0, rows = time.time(), []
        for s in samples:
            stages = runner.encode(s)
            ctx = stages[0]
            ans, scored = answer_target(tok, s["answers"], a.all_answers)
            first = tok(" " + s["answers"][0], add_special_tokens=False)["input_ids"]
            at = find(ctx, first)
            PATCH["needle"] = [(at - 20, at + len(first) + 2)] if protect and at is not None else None
            if protect == "all":  # every needle of the context, the distractors too
                PATCH["needle"] = needle_spans(ctx, tok)
            PATCH["seen"] = {}
            cache = make_cache(model, method, a.budget if method != "full" else None, 256, **options)
            with torch.inference_mode():
                model(input_ids=torch.tensor([ctx]), past_key_values=cache, use_cache=True, logits_to_keep=1)
                share = None
                if at is not None and hasattr(cache.layers[0], "diagnostics"):
                    where = torch.arange(at - 20, at + len(first))
                    share = [round(layer.diagnostics(where)["exact_share"], 2) for layer in cache.layers]
                rest = sum(stages[1:], []) + ans
                pos = torch.arange(len(ctx), len(ctx) + len(rest))[None]
                logits = model(input_ids=torch.tensor([rest]), position_ids=pos, past_key_values=cache, use_cache=True).logits
                lp = torch.log_softmax(logits[0, -len(ans) - 1 : -1].float(), -1)[scored]
                target = torch.tensor(ans)[scored]
                rows.append((float(-lp.gather(1, target[:, None]).mean()), bool((lp.argmax(-1) == target).all()), share))
        nll = sum(r[0] for r in rows) / len(rows)
        em = sum(r[1] for r in rows) / len(rows)
        print(f"{cfg:50s} nll {nll:.3f} em {em:.2f} per-sample {[round(r[0], 2) for r in rows]} ({time.time() - t0:.0f}s)", flush=True)
        for i, row in enumerate(rows):
            if row[2] is not None:
                print(f"   needle tokens held exactly, per layer (sample {i}):", row[2], flush=True)
        print(json.dumps({"config": cfg, "nll": nll, "em": em, "per_sample": [r[0] for r in rows]}), flush=True)


if __name__ == "__main__":
    main()
