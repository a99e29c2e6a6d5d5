"""Training tools around the library: ``armkv train`` and ``armkv calibrate``.

- ``data``: documents (local files, Hugging Face datasets, the offline default corpus)
  packed into fixed-length sequences with a resumable position.
- ``trainer``: ``train(model, loss_fn, data, config)``, generic over a model and a loss;
  the paper's optimiser recipe, token batches, bf16, schedules, exact resume, data
  parallel under torchrun.
- ``checkpoint``: atomic safetensors + JSON checkpoints.
- ``losses``: cross-entropy, distillation, and the hooks ARM layers plug into.
- ``calibrate``: pre-RoPE key collection for the training-free tree initialisation.

Nothing in the library core imports this package.
"""
