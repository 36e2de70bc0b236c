"""What one llama-server forward costs for 1, 2, 3, ... tokens: the price of verifying a draft there.

    python scripts/llama_forward_cost.py LLM.gguf [LLM2.gguf ...] [--tokens 1,2,3,4,8,16,32] [--repeats 10]

For each GGUF, starts llama-server (``boosttune/llama_cpp.py``: the binary bench uses, torch's thread
count), sends prompts of P fixed token ids with one token to predict and no prompt cache, and prints
llama.cpp's own ``prompt_ms`` for them (median of ``--repeats``, after two warm-ups) and its ratio to a
one-token forward. A speculative step verifies the drafted tokens plus one in such a forward; it pays
only when the tokens it commits exceed that ratio plus the drafter's own cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import urllib.request
from pathlib import Path

import torch

from boosttune.core.table import text_table
from boosttune.llama_cpp import LlamaServer, find_server

FIRST_ID = 1000
"""The prompts are ids FIRST_ID, FIRST_ID + 1, ...: ordinary tokens of the default vocabulary."""


def forward_ms(server: LlamaServer, n: int) -> float:
    """llama.cpp's prompt_ms for one forward of ``n`` prompt tokens (nothing cached)."""
    body = {"prompt": list(range(FIRST_ID, FIRST_ID + n)), "n_predict": 1, "cache_prompt": False, "temperature": 0}
    req = urllib.request.Request(server.url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        timings = json.loads(resp.read())["timings"]
    assert timings["prompt_n"] == n, timings
    return float(timings["prompt_ms"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="+", help="the LLM's GGUF file(s)")
    ap.add_argument("--tokens", default="1,2,3,4,8,16,32", help="forward sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--llama-server", default=None, help="the binary (default: as bench finds it)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.tokens.split(",")]
    binary = find_server(args.llama_server)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.gguf:
            log = Path(tmp) / "llama-server.log"
            with LlamaServer(binary, Path(path), torch.get_num_threads(), 1024, [], log) as server:
                times = {}
                for n in sizes:
                    samples = [forward_ms(server, n) for _ in range(args.repeats + 2)][2:]
                    times[n] = statistics.median(samples)
                one = times.get(1)
                for n in sizes:
                    rows.append([Path(path).name, str(n), f"{times[n]:.2f}", f"{times[n] / one:.2f}" if one else "-"])
    print(f"llama-server {binary}, {torch.get_num_threads()} threads; median of {args.repeats}")
    print("\n".join(text_table([["gguf", "tokens", "forward ms", "x one token"], *rows])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
