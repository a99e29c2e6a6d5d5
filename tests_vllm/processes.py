"""Jobs run in processes of their own (every vLLM process loads the plugins anew): ``engine_run.py``
in vLLM's Python, ``hf_reference.py`` in the main environment's. A :class:`Job` starts when it is
made, so jobs made together run side by side on the machine's cores; ``result()`` waits for one."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
_ids = itertools.count()
# One thread a process, the engine in the process itself, and its thread not pinned: vLLM's CPU
# worker binds its threads to the same core in every process ("auto"), so that processes run
# side by side would share one core.
ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class Job:
    def __init__(self, script: str, job: dict, tmp: Path, python: str = sys.executable):
        n = next(_ids)
        path = tmp / f"job-{n}.json"
        path.write_text(json.dumps(job))
        self.script, self.stdout, self.stderr = script, tmp / f"job-{n}.out", tmp / f"job-{n}.err"
        env = dict(os.environ, **ENV)
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([python, str(HERE / script), str(path)], stdout=out, stderr=err, env=env)

    def finish(self) -> tuple[int, str]:
        """The process's exit status and its standard error, once it has ended."""
        return self.proc.wait(), self.stderr.read_text()

    def result(self):
        """The job's printed result (a list for a job of ``jobs``); fails with its stderr's tail."""
        code, stderr = self.finish()
        lines = [line for line in self.stdout.read_text().splitlines() if line.startswith("RESULT ")]
        assert code == 0 and lines, f"{self.script} failed:\n{stderr[-4000:]}"
        return json.loads(lines[-1][len("RESULT ") :])
