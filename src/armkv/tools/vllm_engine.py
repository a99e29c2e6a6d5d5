"""``armkv generate --engine vllm`` and ``armkv eval ruler --engine vllm``: the same requests and
results, answered by vLLM with armkv's plugin (``armkv.vllm``; docs/serving.md) instead of the
HF path.

All requests go to one vLLM engine at once (continuous batching). What differs from the HF
path: a request's context and question are one prompt (the HF path feeds them as two
prefills, so the question starts a chunk of its own there); ``cache_bytes`` is the largest
peak any request of the run reached, summed over the layers (vLLM does not tell the
attention layers which request a memory serves); the timings are the run's, per request.
"""

from __future__ import annotations

import os
import sys
import time

from armkv.errors import ArmkvError

# The one command that builds vLLM's environment (vLLM pins its own transformers, so it gets a
# venv of its own); docs/serving.md.
VLLM_ENV_COMMAND = (
    "python -m venv ~/.venvs/armkv-vllm && ~/.venvs/armkv-vllm/bin/pip install 'armkv[vllm]' && "
    "~/.venvs/armkv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


def require_vllm(command: str = "generate") -> None:
    """A one-line error naming the command that builds vLLM's environment, where vLLM is missing
    (``command``: the armkv subcommand to run there, e.g. ``eval ruler``)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ArmkvError(
            f"--engine vllm needs vLLM, which lives in an environment of its own; build it with: {VLLM_ENV_COMMAND} "
            f"and run ~/.venvs/armkv-vllm/bin/armkv {command} --engine vllm ..."
        ) from None


def check_served(methods: list[str], compile: bool) -> None:
    """One-line errors, before vLLM is imported, for what ``--engine vllm`` does not run."""
    from armkv.vllm.settings import METHODS

    for method in methods:
        if method not in METHODS:
            raise ArmkvError(
                f"--engine vllm serves the methods {', '.join(METHODS)}, not {method!r}: drop it from --methods "
                "(or run it with --engine hf)"
            )
    if compile:
        raise ArmkvError("--compile is the HF path's; drop it with --engine vllm")


def model_folder(model: str | None) -> str:
    """The local model folder vLLM loads: ``--model``, or the default model as armkv's main
    environment converted it."""
    from armkv.tools.preflight import model_folder as folder_of

    folder = folder_of(model)
    if folder is None or not (folder / "config.json").is_file():
        raise ArmkvError(
            f"{folder or 'the default model'} holds no converted model: run `armkv generate` once in armkv's main "
            "environment to convert it, or pass --model FOLDER"
        )
    return str(folder)


def make_llm(model: str, max_model_len: int):
    """One vLLM engine (in this process) for ``model``, with the plugin set by ``ARMKV_VLLM``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(
        model=model,
        dtype="float32",
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        enforce_eager=True,  # (a run of requests: vLLM's torch.compile of the model costs more than it saves here)
        gpu_memory_utilization=float(os.environ.get("ARMKV_VLLM_MEMORY", "0.3")),
    )


def encode(tokenizer, request: dict, chat: bool) -> list[int]:
    """A request's prompt ids: the HF path's stages (``Runner.encode``) as one prompt."""
    if "prompt" in request:
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": request["prompt"]}], add_generation_prompt=True, tokenize=False
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(request["prompt"])["input_ids"]
    context, question, prefix = request["context"], request.get("question", ""), request.get("answer_prefix", "")
    if chat:
        content = context + ("\n\n" + question if question else "")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        cut = text.index(context) + len(context)
        first, rest = text[:cut], text[cut:] + prefix
        ids = tokenizer(first, add_special_tokens=False)["input_ids"]
    else:
        rest = question + prefix
        ids = tokenizer(context)["input_ids"]
    return ids + (tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else [])


def _forget_memories(worker) -> None:
    """Drop every memory the ARM layers hold (between requests, with none in flight)."""
    from armkv.vllm.backend import ARMAttention

    for module in worker.model_runner.model.modules():
        if isinstance(module, ARMAttention):
            module.impl.memories.clear()


def _arm_peaks(worker) -> list[dict]:
    from armkv.vllm.backend import ARMAttention

    return [
        {s: mem.layer.peak_bytes for s, mem in module.impl.memories.items()}
        for module in worker.model_runner.model.modules()
        if isinstance(module, ARMAttention)
    ]


def run(args, requests: list[dict], output, budget, options: dict, sampling: dict | None) -> tuple[int, bool]:
    """Answer the requests not yet in ``output`` through vLLM: ``(requests failed, whether the run
    went through them all)``, the contract of ``generate.run``."""
    check_served([args.method], args.compile)
    require_vllm()
    from armkv.tools.generate import id_key
    from armkv.vllm.settings import Settings

    todo = [r for r in requests if id_key(r["id"]) not in output.done]
    if not todo:
        return 0, True
    os.environ["ARMKV_VLLM"] = Settings(args.method, budget, args.chunk, options).to_env()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    model = model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    prompts = [encode(tokenizer, r, args.chat) for r in todo]
    llm = make_llm(model, max(len(p) for p in prompts) + args.max_new_tokens)
    if sampling is None:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    else:
        params = SamplingParams(
            temperature=sampling["temperature"] or 1.0,
            top_p=sampling["top_p"] or 1.0,
            top_k=sampling["top_k"] or 0,
            seed=sampling["seed"],
            max_tokens=args.max_new_tokens,
        )
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    seconds = time.perf_counter() - start
    layers = llm.collective_rpc(_arm_peaks)[0]
    peak = sum(max(layer.values(), default=0) for layer in layers)
    for request, prompt, out in zip(todo, prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        output.write(
            {
                "id": request["id"],
                "method": args.method,
                "output": tokenizer.decode(tokens, skip_special_tokens=True),
                "prompt_tokens": len(prompt),
                "cache_bytes": peak,
                "prefill_seconds": None,
                "decode_seconds_per_token": seconds / max(1, sum(len(o.outputs[0].token_ids) for o in outs)),
            },
            request,
        )
    print(f"armkv generate: {len(todo)} requests through vLLM in {seconds:.1f} s", file=sys.stderr)
    return 0, True


class VLLMRunner:
    """:class:`armkv.hf.runner.Runner`'s contract through vLLM with the plugin: one engine for one
    method at one budget, answering one request at a time (greedy), as an eval feeds a runner.

    What differs from the HF path's results: a request's context and question are one prompt
    (the HF path feeds the question as a second prefill, so its chunks fall elsewhere); no
    ``memory`` report. ``prefill_seconds`` is the time to the first token, as the HF path's.
    """

    def __init__(
        self, model: str, tokenizer, method: str, budget, chunk: int, chat: bool, max_model_len: int, **options
    ):
        from armkv.tools.preflight import resolve_budget
        from armkv.vllm.settings import Settings

        self.tokenizer, self.method, self.chat, self.max_model_len = tokenizer, method, chat, max_model_len
        os.environ["ARMKV_VLLM"] = Settings(method, resolve_budget(method, budget), chunk, options).to_env()
        self.llm = make_llm(model, max_model_len)

    def generate(self, requests: list[dict], max_new_tokens: int = 64, do_sample: bool = False) -> list[dict]:
        from vllm import SamplingParams

        from armkv.hf.runner import check_request

        if do_sample:
            raise ArmkvError("the vLLM runner of the evals decodes greedily")
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        results = []
        for request in requests:
            check_request(request)
            prompt = encode(self.tokenizer, request, self.chat)
            if len(prompt) + max_new_tokens > self.max_model_len:
                raise ArmkvError(
                    f"request {request['id']!r}: {len(prompt)} prompt tokens + {max_new_tokens} new tokens exceed the "
                    f"model's limit of {self.max_model_len} positions"
                )
            self.llm.collective_rpc(_forget_memories)  # so that the layers' memories are this request's alone
            tokens, prefill, decode = self._step(prompt, params)
            layers = self.llm.collective_rpc(_arm_peaks)[0]
            results.append(
                {
                    "id": request["id"],
                    "method": self.method,
                    "output": self.tokenizer.decode(tokens, skip_special_tokens=True),
                    "prompt_tokens": len(prompt),
                    "cache_bytes": sum(max(layer.values(), default=0) for layer in layers),
                    "prefill_seconds": prefill,
                    "decode_seconds_per_token": decode,
                }
            )
        return results

    def _step(self, prompt: list[int], params) -> tuple[list[int], float, float]:
        """One request stepped through the engine: its tokens, the seconds to its first token (the
        prefill) and per later token."""
        from vllm import TokensPrompt

        engine = self.llm.llm_engine
        self._requests = getattr(self, "_requests", 0) + 1
        engine.add_request(f"armkv-{self._requests}", TokensPrompt(prompt_token_ids=prompt), params)
        start, first, final = time.perf_counter(), None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    final = out
        end = time.perf_counter()
        tokens = list(final.outputs[0].token_ids)
        first = end if first is None else first
        return tokens, first - start, (end - first) / max(1, len(tokens) - 1)

    def close(self) -> None:
        """Free the engine (an eval runs one method's engine at a time)."""
        import gc

        self.llm = None
        gc.collect()


def runner_factory(model: str, tokenizer, *, budget, chunk: int, chat: bool, max_model_len: int):
    """``(method, options) -> VLLMRunner``, the evals' runner factory for ``--engine vllm``; the
    previous runner's engine is freed before the next one starts."""
    made: list[VLLMRunner] = []

    def make(method: str, options: dict) -> VLLMRunner:
        options = dict(options)
        use_chat = options.pop("chat", chat)
        while made:
            made.pop().close()
        made.append(VLLMRunner(model, tokenizer, method, budget, chunk, use_chat, max_model_len, **options))
        return made[-1]

    return make


__all__ = [
    "VLLM_ENV_COMMAND",
    "VLLMRunner",
    "check_served",
    "encode",
    "make_llm",
    "model_folder",
    "require_vllm",
    "run",
    "runner_factory",
]
