"""Load test of `boosttune serve`: requests/s, tokens/s, latency percentiles and τ at several concurrencies.

Starts ``boosttune serve BUNDLE`` in a subprocess on a free local port (or uses ``--url``), then for
each concurrency level C sends ``--requests`` requests from C client threads with the official
openai client and reports requests/s, completion tokens/s, p50/p95/p99 latency, mean queue wait and
the τ (tokens per LLM forward) that the server reported in each response's ``boosttune`` statistics.
Where a server's levels start with one client, each later level's p50 is also given against that
single-client p50 ("p50 / 1 client"), the measure of how much a loaded server slows each request.

``--servers one,batched`` runs the same levels against a server that decodes one request at a time
(``--max-batch 1``) and one that batches (``--max-batch``), one after the other in one run, and for
greedy decoding says whether every batched answer equals the one-at-a-time answer to the same request.

    .venv/bin/python scripts/bench_server.py BUNDLE --servers one,batched --concurrency 1,4,16,32 \\
        --requests 64 --max-tokens 64 --dtype bf16 --out runs/bench-server.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
MODES = ("default", "one", "batched")
FALLBACK_PROMPTS = ["Write a haiku about the sea.", "Explain why the sky is blue.", "Give three tips for sleeping well.",
                    "What is a prime number?", "Summarise the plot of Hamlet in two sentences."]


@dataclass
class LevelResult:
    """One concurrency level's figures."""

    concurrency: int
    requests: int
    wall_s: float
    requests_per_s: float
    completion_tokens_per_s: float
    latency_p50_s: float
    latency_p95_s: float
    latency_mean_s: float
    queue_mean_s: float
    tau: float
    completion_tokens: int
    latency_p99_s: float = float("nan")
    server: str = "default"
    identical_to_one_at_a_time: int | None = None
    p50_over_one_client: float | None = None  # against the 1-client level of the same server start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _prompts(path: str | None) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from boosttune.core.prompts import read_prompts

    source = Path(path) if path else MT_BENCH
    if source.is_file():
        return [p.text for p in read_prompts(source)]
    if path:
        raise SystemExit(f"--prompts: no such file: {path}")
    # Figures from these short prompts are not comparable with MT-bench's (a checkout outside the workplace's
    # layout took them silently: 88.8 against 68.5 tok/s for one client, same bundle and server).
    print(f"{MT_BENCH} not found: sending {len(FALLBACK_PROMPTS)} short built-in prompts instead (--prompts FILE "
          "to choose)", file=sys.stderr, flush=True)
    return FALLBACK_PROMPTS


def _start_server(args: argparse.Namespace, max_batch: int | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "boosttune.cli", "serve", args.bundle, "--port", str(port), "--dtype", args.dtype,
           "--log-level", "warning", "--max-queue", str(max(64, max(args.concurrency) * 2))]
    if max_batch is not None:
        cmd += ["--max-batch", str(max_batch)]
    if args.llm:
        cmd += ["--llm", args.llm]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.compile:
        cmd += ["--compile"]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    if args.draft_max_batch is not None:
        cmd += ["--draft-max-batch", str(args.draft_max_batch)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before answering")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"the server did not answer /health within {args.start_timeout} s")


def _one(client: OpenAI, model: str, prompt: str, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    if args.chat:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=args.max_tokens, temperature=args.temperature)
    else:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                      temperature=args.temperature)
    stats = r.model_extra.get("boosttune", {})
    text = r.choices[0].message.content if args.chat else r.choices[0].text
    return {"latency": time.perf_counter() - start, "tokens": r.usage.completion_tokens,
            "steps": stats.get("steps", 0), "queue": stats.get("queue_seconds", 0.0), "text": text}


def run_level(client: OpenAI, model: str, prompts: list[str], concurrency: int, args: argparse.Namespace,
              texts: list[str] | None = None) -> LevelResult:
    """Send ``args.requests`` requests from ``concurrency`` threads; prompts are taken in turn. ``texts``,
    if given, receives each request's answer in request order."""
    chosen = [prompts[i % len(prompts)] for i in range(args.requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda p: _one(client, model, p, args), chosen))
    wall = time.perf_counter() - start
    latencies = [r["latency"] for r in rows]
    tokens = sum(r["tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    if texts is not None:
        texts.extend(r["text"] for r in rows)
    return LevelResult(
        concurrency=concurrency, requests=len(rows), wall_s=wall, requests_per_s=len(rows) / wall,
        completion_tokens_per_s=tokens / wall, latency_p50_s=_percentile(latencies, 0.5),
        latency_p95_s=_percentile(latencies, 0.95), latency_p99_s=_percentile(latencies, 0.99), latency_mean_s=statistics.fmean(latencies),
        queue_mean_s=statistics.fmean(r["queue"] for r in rows), tau=tokens / steps if steps else float("nan"),
        completion_tokens=tokens,
    )


def format_table(results: list[LevelResult]) -> str:
    head = ("server", "clients", "requests", "req/s", "tok/s", "p50 s", "p50 / 1 client", "p95 s", "p99 s", "queue s",
            "tau", "same answers")
    rows = [head] + [
        (r.server, str(r.concurrency), str(r.requests), f"{r.requests_per_s:.2f}", f"{r.completion_tokens_per_s:.1f}",
         f"{r.latency_p50_s:.2f}", "-" if r.p50_over_one_client is None else f"{r.p50_over_one_client:.2f}x",
         f"{r.latency_p95_s:.2f}", f"{r.latency_p99_s:.2f}", f"{r.queue_mean_s:.2f}",
         f"{r.tau:.2f}",
         "-" if r.identical_to_one_at_a_time is None else f"{r.identical_to_one_at_a_time}/{r.requests}")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", nargs="?", help="bundle to serve (omit with --url)")
    p.add_argument("--url", default=None, help="use a running server (http://host:port) instead of starting one")
    p.add_argument("--llm", default=None, help="serve: where the bundle's LLM is")
    p.add_argument("--dtype", default="fp32", help="serve: LLM dtype")
    p.add_argument("--threads", type=int, default=None, help="serve: torch threads of the engine")
    p.add_argument("--compile", action="store_true", help="serve --compile: the compiled CPU forward")
    # serving.quantize.SCHEMES, spelled out: this client imports no torch
    p.add_argument("--quantize", choices=["int8", "int4", "w8a8"], default=None, help="serve --quantize: the LLM's weights quantized")
    p.add_argument("--draft-max-batch", type=int, default=None, help="serve --draft-max-batch (0: plain steps only)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-chat", dest="chat", action="store_false", help="use /v1/completions instead of chat")
    p.add_argument("--prompts", default=None, help="JSONL/text prompt file (default: MT-bench first turns)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--servers", default="default",
                   help="comma-separated server modes, run one after the other: default (serve's own batching), "
                        "one (--max-batch 1), batched (--max-batch N)")
    p.add_argument("--max-batch", type=int, default=16, help="serve --max-batch of the 'batched' mode")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.url and not args.bundle:
        p.error("give a BUNDLE or --url")
    if args.requests < 1 or min(args.concurrency) < 1:
        p.error("--requests and every --concurrency value must be >= 1")
    args.servers = [m.strip() for m in args.servers.split(",") if m.strip()]
    if not set(args.servers) <= set(MODES) or not args.servers:
        p.error(f"--servers takes {', '.join(MODES)}")
    if args.url and len(args.servers) > 1:
        p.error("--url measures the one server it names: give one --servers mode")
    prompts = _prompts(args.prompts)

    results: list[LevelResult] = []
    answers: dict[str, dict[int, list[str]]] = {}
    model = None
    for mode in args.servers:
        max_batch = {"default": None, "one": 1, "batched": args.max_batch}[mode]
        proc, url = (None, args.url.rstrip("/")) if args.url else _start_server(args, max_batch)
        answers[mode] = {}
        try:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
            model = client.models.list().data[0].id
            _one(client, model, prompts[0], args)  # warm-up
            one_client = None  # this server's 1-client p50, where that level ran first
            for c in args.concurrency:
                level = run_level(client, model, prompts, c, args, answers[mode].setdefault(c, []))
                level.server = mode
                if c == 1:
                    one_client = level.latency_p50_s
                elif one_client:
                    level.p50_over_one_client = level.latency_p50_s / one_client
                results.append(level)
                print(f"{mode} server, concurrency {c}: {level.requests_per_s:.2f} req/s, "
                      f"{level.completion_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    if "one" in answers and args.temperature == 0:
        for r in results:
            if r.server != "one":
                same = zip(answers[r.server][r.concurrency], answers["one"][r.concurrency], strict=True)
                r.identical_to_one_at_a_time = sum(a == b for a, b in same)
    print(format_table(results))
    summary = {"url": args.url, "bundle": args.bundle, "model": model, "dtype": args.dtype, "threads": args.threads,
               "chat": args.chat, "servers": args.servers, "max_batch": args.max_batch,
               "max_tokens": args.max_tokens, "temperature": args.temperature, "levels": [asdict(r) for r in results]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
