"""The generation engine every tool uses (``armkv generate``, the demo, evaluations, benchmarks).

A request is ``{"id", "context", "question"?, "answer_prefix"?}`` or ``{"id", "prompt"}``.
The context is fed first and the cache brings itself back to budget chunk by chunk while
reading it; only then is the question (and answer prefix) fed, as a second prefill. So
every method compresses the context without knowing the question (as kvpress evaluates).
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from armkv.errors import ArmkvError


def check_request(request: dict) -> None:
    """Raise ArmkvError unless ``request`` is a JSON object with an id and either a context or a
    prompt (strings), and some text to feed."""
    if not isinstance(request, dict):
        raise ArmkvError(f"a request is a JSON object with an 'id', not {type(request).__name__} {request!r:.40}")
    if "id" not in request:
        raise ArmkvError("a request needs an 'id'")
    has_context, has_prompt = "context" in request, "prompt" in request
    if has_context == has_prompt:
        raise ArmkvError(f"request {request['id']!r} needs exactly one of 'context' or 'prompt'")
    if has_prompt and ("question" in request or "answer_prefix" in request):
        raise ArmkvError(
            f"request {request['id']!r}: 'question' and 'answer_prefix' go with a 'context'; a 'prompt' is the whole "
            "text (put them into it, or give the text as 'context')"
        )
    for key in ("context", "question", "answer_prefix", "prompt"):
        if key in request and not isinstance(request[key], str):
            raise ArmkvError(f"request {request['id']!r}: {key!r} must be a string")
    if not any(request.get(key) for key in ("context", "question", "answer_prefix", "prompt")):
        raise ArmkvError(f"request {request['id']!r}: the prompt is empty")


def request_seed(seed: int, request_id) -> int:
    """The seed of one request's draws: a 64-bit hash of ``seed`` and the request's id."""
    text = json.dumps([int(seed), request_id], sort_keys=True, ensure_ascii=True)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")


class Runner:
    """Generates answers with one cache method at one budget.

    Parameters
    ----------
    model, tokenizer : a transformers causal LM of the Llama family and its tokenizer
    method : a registered cache method
    budget : token-equivalents per layer (None for unbounded methods)
    chunk : P, the prefill chunk
    chat : wrap context + question in the tokenizer's chat template; the answer prefix goes
        after the start of the assistant turn
    compile : decode through a compiled forward of the whole model with the cache
        (``make_cache(compile=)``: True, or a dict of ``torch.compile`` arguments); bounded
        methods only. The first request pays the compilation
    method_options : passed to the method (e.g. ``adapter=`` for arm, ``bits=`` for kivi)
    """

    def __init__(
        self,
        model,
        tokenizer,
        method: str,
        budget: int | None = None,
        chunk: int = 256,
        chat: bool = False,
        compile: bool | dict = False,
        **method_options,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.method, self.budget, self.chunk, self.chat = method, budget, chunk, chat
        self.compile = compile
        self.method_options = method_options
        from armkv.hf.attach import model_info

        self.info = model_info(model)
        self.new_cache()  # fails now, not at the first request, on a bad method, budget or option
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos = set(eos)

    def new_cache(self, horizon: int | None = None):
        """A fresh cache; ``horizon``: the tokens it will see, for methods that plan by length."""
        from armkv.hf.attach import make_cache

        return make_cache(
            self.model,
            self.method,
            self.budget,
            self.chunk,
            horizon=horizon,
            compile=self.compile,
            **self.method_options,
        )

    # ------------------------------------------------------------------ prompts
    def encode(self, request: dict) -> list[list[int]]:
        """The token ids of a request's prefill stages: [prompt] or [context, question + answer prefix]."""
        check_request(request)
        tok = self.tokenizer
        if "prompt" in request:
            if self.chat:
                text = tok.apply_chat_template(
                    [{"role": "user", "content": request["prompt"]}], add_generation_prompt=True, tokenize=False
                )
                return [tok(text, add_special_tokens=False)["input_ids"]]
            return [tok(request["prompt"])["input_ids"]]
        context = request["context"]
        question = request.get("question", "")
        prefix = request.get("answer_prefix", "")
        if self.chat:
            content = context + ("\n\n" + question if question else "")
            text = tok.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
            cut = text.index(context) + len(context)
            first, rest = text[:cut], text[cut:] + prefix
            stages = [tok(first, add_special_tokens=False)["input_ids"]]
        else:
            rest = question + prefix
            stages = [tok(context)["input_ids"]]
        if rest:
            stages.append(tok(rest, add_special_tokens=False)["input_ids"])
        return stages

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        requests: list[dict],
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        progress=None,
        seed: int | None = None,
    ) -> list[dict]:
        """Answer each request, one at a time, each with a fresh cache.

        With ``do_sample``, unset ``temperature`` / ``top_k`` / ``top_p`` come from the model's
        generation config; ``seed`` (optional) seeds each request's draws afresh from the seed and
        the request's id (:func:`request_seed`), so a request's answer does not depend on the
        requests before it (a resumed run gives the same answers) and requests that share a
        prompt draw different samples.

        Returns
        -------
        One dict per request: ``id, method, output, prompt_tokens, cache_bytes`` (the cache's peak
        size during the request), ``prefill_seconds``, ``decode_seconds_per_token``.
        ``progress`` (optional) is called with each result as it is done.
        """
        results = []
        for request in requests:
            stages = self.encode(request)
            tokens, timing, cache = self.generate_ids(
                stages,
                max_new_tokens,
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                request_id=request["id"],
                watch=request.get("watch"),
                seed=None if seed is None else request_seed(seed, request["id"]),
            )
            results.append(
                {
                    "id": request["id"],
                    "method": self.method,
                    "output": self.tokenizer.decode(tokens, skip_special_tokens=True),
                    "prompt_tokens": sum(len(s) for s in stages),
                    "cache_bytes": cache.peak_bytes(),
                    **timing,
                }
            )
            if progress is not None:
                progress(results[-1])
        return results

    @torch.inference_mode()
    def generate_ids(
        self,
        stages: list[list[int]],
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        request_id=None,
        watch: list[str] | None = None,
        seed: int | None = None,
    ):
        """Prefill each stage in turn, then decode one sequence.

        watch : strings of the prompt (e.g. a needle's value) whose tokens a memory method
            should report on after the prefill (:meth:`memory_report`)

        Returns
        -------
        (new token ids up to and including the first end-of-sequence token, timing dict (with
        ``memory`` when the cache reports on itself), the cache)
        """
        prompt_tokens = sum(len(s) for s in stages)
        if prompt_tokens == 0:
            raise ArmkvError(f"request {request_id!r}: the prompt is empty")
        limit = self.info.max_positions
        if prompt_tokens + max_new_tokens > limit:
            raise ArmkvError(
                f"request {request_id!r}: {prompt_tokens} prompt tokens + {max_new_tokens} new tokens exceed the "
                f"model's limit of {limit} positions"
            )
        device = self.model.device
        cache = self.new_cache(horizon=prompt_tokens + max_new_tokens)
        pick = self._sampler(do_sample, temperature, top_k, top_p, seed)
        start = time.perf_counter()
        position = 0
        for stage in stages:
            if not stage:
                continue
            ids = torch.tensor([stage], device=device)
            logits = self._forward(ids, cache, position)
            position += len(stage)
        prefill = time.perf_counter() - start
        memory = self.memory_report(cache, sum(stages, []), watch or [])
        tokens: list[int] = []
        start = time.perf_counter()
        steps = 0
        while True:
            token = pick(logits)
            tokens.append(token)
            if token in self.eos or len(tokens) >= max_new_tokens:
                break
            logits = self._forward(torch.tensor([[token]], device=device), cache, position)
            position += 1
            steps += 1
        decode = time.perf_counter() - start
        timing = {"prefill_seconds": prefill, "decode_seconds_per_token": decode / max(steps, 1)}
        if memory is not None:
            timing["memory"] = memory
        return tokens, timing, cache

    def memory_report(self, cache, ids: list[int], watch: list[str]) -> dict | None:
        """What a memory method (one whose layers have ``diagnostics``, e.g. arm) holds: slots
        used, tokens per slot, and, for the tokens of each watched string found in ``ids``,
        the share still held exactly, over all layers and per layer. None for other methods."""
        layers = [layer for layer in cache.layers if hasattr(layer, "diagnostics")]
        if not layers:
            return None
        positions = []
        for text in watch:
            for variant in (" " + text, text):
                sub = self.tokenizer(variant, add_special_tokens=False)["input_ids"]
                hits = [i for i in range(len(ids) - len(sub) + 1) if sub and ids[i : i + len(sub)] == sub]
                if hits:
                    positions += [p for i in hits for p in range(i, i + len(sub))]
                    break
        at = torch.tensor(sorted(set(positions))) if positions else None
        per_layer = [layer.diagnostics(at) for layer in layers]
        report = {
            "slots_used": sum(d["slots_used"] for d in per_layer) / len(per_layer),
            "slots": sum(d["slots"] for d in per_layer) / len(per_layer),  # layers may hold different numbers
            "tokens_per_slot": sum(d["tokens_per_slot"] for d in per_layer) / len(per_layer),
        }
        if at is not None:
            shares = [d["exact_share"] for d in per_layer]
            report["watched_tokens"] = len(at)
            report["exact_share"] = sum(shares) / len(shares)
            report["exact_share_by_layer"] = [round(x, 3) for x in shares]
        return report

    def _forward(self, ids: torch.Tensor, cache, position: int) -> torch.Tensor:
        """Feed ids [1, T] at positions position.. ; returns the last position's logits [1, V] (fp32)."""
        positions = torch.arange(position, position + ids.shape[1], device=ids.device)[None]
        # (one token with a cache made with `compile`: the compiled decode forward, ArmkvCache.forward)
        out = cache.forward(self.model, ids, position_ids=positions, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _sampler(self, do_sample: bool, temperature, top_k, top_p, seed: int | None = None):
        """logits [1, V] -> next token id, as ``model.generate`` picks it (argmax, or the same
        temperature / top-k / top-p warpers in the same order, then one multinomial draw; from
        a generator seeded with ``seed`` where one is given)."""
        if not do_sample:
            return lambda logits: int(logits.argmax(-1))
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        config = self.model.generation_config
        temperature = temperature if temperature is not None else config.temperature
        top_k = top_k if top_k is not None else config.top_k
        top_p = top_p if top_p is not None else config.top_p
        warpers = LogitsProcessorList()
        if temperature is not None and temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k is not None and top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        if top_p is not None and top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))

        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(int(seed))

        def pick(logits: torch.Tensor) -> int:
            scores = warpers(None, logits)
            return int(torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator))

        return pick
