"""An lm-evaluation-harness model, ``armkv``, that runs every request through one cache method.

Both kinds of request go through the cache: loglikelihood requests in :meth:`ArmkvLM._model_call`
(the sequence is fed in one forward with a fresh cache, which the cache processes in chunks
of ``chunk`` tokens: the budgeted chunked prefill, so each token's logits see only what the
method kept of the tokens before its chunk) and generation in :meth:`ArmkvLM._model_generate`.
Without the first, loglikelihood tasks would run the plain model and every method would
score alike.

lm-eval finds models by name only once their module is imported, so run it through this
module::

    python -m armkv.evals.lm_eval_model run --model armkv \\
        --model_args method=arm,budget=512,chunk=256 --tasks hellaswag

or in Python: ``lm_eval.simple_evaluate(model=ArmkvLM(method="arm", budget=512), tasks=[...])``.
Model arguments: ``method``, ``budget`` (token-equivalents per layer; ignored by unbounded
methods), ``chunk``, ``pretrained`` (a model folder; default: the packaged model), ``device``, ``dtype``,
``batch_size``, ``max_length``, and any other key is a method option (``adapter=PATH``).
"""

from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM


@register_model("armkv")
class ArmkvLM(HFLM):
    """:class:`lm_eval.models.huggingface.HFLM` with an armkv cache in every model call."""

    def __init__(
        self,
        method: str = "arm",
        budget: int | None = 512,
        chunk: int = 256,
        pretrained: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int = 64,
        max_length: int | None = None,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        **method_options,
    ):
        from armkv.hf.attach import attach
        from armkv.hf.model import load_model
        from armkv.methods.base import get_method

        # lm-eval's command line passes a device (default cuda) and may pass a dtype by name
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"
        if isinstance(dtype, str):
            dtype = None if dtype == "auto" else getattr(torch, dtype)
        # set before HFLM's init, which may call the model (batch_size="auto")
        self.method = method
        self.cache_budget = budget if get_method(method).bounded else None
        self.chunk = int(chunk)
        self.method_options = method_options
        model, tokenizer = load_model(pretrained, dtype=dtype or torch.float32, device=device)
        attach(model)
        super().__init__(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=batch_size,
            max_batch_size=max_batch_size,
            max_length=max_length,
        )
        self.new_cache()  # a bad budget or option fails here, not mid-evaluation

    def new_cache(self, horizon: int | None = None):
        """A fresh cache; ``horizon``: the tokens it will see (for methods that plan by length)."""
        from armkv.hf.attach import make_cache

        return make_cache(
            self.model, self.method, self.cache_budget, self.chunk, horizon=horizon, **self.method_options
        )

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits [B, T, V] of ``inps`` [B, T], read through a fresh cache of the method.

        lm-eval pads loglikelihood batches on the right, so the pads come after every real
        token and cannot change a real token's logits.
        """
        if attn_mask is not None or labels is not None:
            raise NotImplementedError("armkv serves decoder-only models")
        from armkv.hf.compat import cache_arg

        with torch.no_grad():
            return self.model(inps, **cache_arg(self.new_cache(horizon=inps.shape[1])), use_cache=True).logits

    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs
    ) -> torch.Tensor:
        """``HFLM._model_generate`` with a fresh cache of the method as its cache argument."""
        from armkv.hf.compat import cache_arg

        cache = self.new_cache(horizon=max_length)  # HFLM's max_length: context plus new tokens
        return super()._model_generate(context, max_length, stop, **cache_arg(cache), **generation_kwargs)


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
