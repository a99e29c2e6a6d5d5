"""The plugin's tests run in vLLM's environment (``.ci/run`` builds it; docs/serving.md):
elsewhere they are skipped."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (docs/serving.md builds its environment)")
