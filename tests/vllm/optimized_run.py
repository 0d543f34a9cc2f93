"""Run by test_failures.py as ``python -O -m tests.vllm.optimized_run SOCKET DIR``: a load that
fails in its window (a forced clear revokes its lease), once through KvtierOffloadingConnector and
once through the plain spec path, with every ``assert`` statement compiled out (vLLM's included).
Prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.procs import ChildError

from .harness import EngineRecipe, running, serve_twice
from .test_failures import PROMPT


def main(socket: str, directory: str) -> dict:
    def clear():
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvtierctl"), "--dir", directory, "clear",
                        "--all", "--force"], check=True, capture_output=True)

    result: dict = {"optimize": sys.flags.optimize}
    with running(EngineRecipe("tiny-llama", 1, socket, "optimized")) as (engine, ranks):
        result["rank_optimize"] = [r.call("optimize") for r in ranks]
        request, right_bytes = serve_twice(engine, ranks, PROMPT, clear)
        result["connector"] = {"status": request.status.name, "right_bytes": right_bytes,
                               "first_computed": engine.first_computed["again"]}
    plain = EngineRecipe("tiny-llama", 1, socket, "optimized-plain", connector="OffloadingConnector")
    with running(plain) as (engine, ranks):
        try:
            serve_twice(engine, ranks, PROMPT, clear)
            result["plain"] = "served"          # what must not happen: bytes it could not load
        except ChildError as exc:
            result["plain"] = exc.type
    return result


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))
