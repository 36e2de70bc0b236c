"""The block `boosttune serve` prints once it listens: where to send requests, under which model name, what
drafts them, and a request to copy."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence

WILDCARDS = ("0.0.0.0", "::", "")
"""Hosts that mean every interface: clients on this machine reach them at the loopback address."""


def base_url(host: str, port: int) -> str:
    """The URL a client on this machine uses (``http://HOST:PORT/v1``; IPv6 in brackets)."""
    if host in WILDCARDS:
        host = "127.0.0.1"
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def curl_example(url: str, model: str) -> str:
    """A one-line chat completion against ``url``, shell-quoted."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32},
                      ensure_ascii=False)
    return f"curl {url}/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"


def startup_banner(host: str, port: int, model: str, drafters: Sequence[tuple[str, str]], prompt_lookup: int,
                   scheduler: str | None, batching: str = "one request at a time") -> list[str]:
    """The lines, for a server on ``host``:``port`` serving ``model`` with ``drafters`` ((name, kind) pairs, as
    the bundle's manifest lists them), prompt lookup of chains up to ``prompt_lookup`` (0: none), the
    learned ``scheduler`` (a description; None: every request drafts with all drafters) and how many
    requests it decodes at once (``batching``, a description)."""
    url = base_url(host, port)
    listed = ", ".join(f"{name} ({kind})" for name, kind in drafters) or "none (plain decoding)"
    if prompt_lookup:
        listed += f", prompt lookup (up to {prompt_lookup} tokens)"
    where = " (every interface: other machines use this one's address)" if host in WILDCARDS else ""
    return [
        f"boosttune serve: listening on {url}{where}",
        f"  model:     {model}   (the \"model\" clients send)",
        f"  drafters:  {listed}",
        f"  scheduler: {scheduler or 'none: every request drafts with all drafters'}",
        f"  batching:  {batching}",
        f"  try:       {curl_example(url, model)}",
    ]
