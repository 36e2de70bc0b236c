"""The teacher phase against an OpenAI-compatible completions server (``teacher.backend: openai``).

On a cluster the LLM's continuations come from a serving fleet (vLLM, SGLang, llama-server, or
`boosttune serve`) rather than from HF ``generate`` in the training job. This backend sends every
prompt, already token ids, to ``POST {teacher.endpoint}/completions`` (all of those servers take a
list of ints as the prompt) and writes the same shards as the local backends
(:mod:`boosttune.train.teacher.shards`: same schema, same resumption: a shard is written whole once
all its prompts are answered).

Before the LLM's weights load, :meth:`OpenAIBackend.preflight` checks the server's model and
tokenizer, so that a wrong endpoint fails in seconds. Before any shard is generated,
:meth:`OpenAITeacher.preflight` checks, in one or two seconds:

- the server answers ``GET /models`` and serves ``teacher.model`` (empty: its first model);
- its tokenizer is the LLM's: probe texts (multilingual, code, whitespace runs) are sent as text
  prompts with ``max_tokens: 1``; the ids the server shows for them (vLLM's and boosttune's
  ``prompt_token_ids``, a ``/tokenize`` endpoint as vLLM and llama-server have) must spell
  them in the LLM's vocabulary and split them as the LLM's tokenizer does (all but one probe), or,
  where it shows no ids, ``usage.prompt_tokens`` must equal the local counts
  (:meth:`OpenAITeacher.check_tokenizer`);
- one real request (the first prompt, the configured sampling) is answered, with top-k log-probs when
  ``teacher.topk_logprobs`` asks for them, and reads the prompt ids as sent (no BOS added).

Output token ids are exact where the server returns them: ``token_ids`` in the choice (vLLM's
``return_token_ids: true`` extension, which `boosttune serve` also has), or ``__verbose.tokens`` (llama-server with
``return_tokens`` and ``verbose``: tools/server/server-schema.cpp, server-task.cpp). Elsewhere the
text is re-tokenised, which can differ from the ids the LLM wrote (the report counts which way every
continuation went, and how often a decode -> encode round trip of the exact ids differs). A "stop"
continuation ends with its EOS token, as the local backends' do (``cut_at_eos``); servers that leave
the EOS out of the ids get it put back (counted as ``eos_appended``).

Transient failures (connection errors, timeouts, 429, 5xx) are retried with exponential backoff;
anything else stops the phase with the server's message. Shards written before stay.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import httpx
from transformers import AutoTokenizer

from boosttune.config import TeacherConfig
from boosttune.core.models import resolve_model_path
from boosttune.core.progress import progress
from boosttune.core.rundir import RunDir
from boosttune.train.sources import TrainPrompt
from boosttune.train.teacher.base import TeacherBackend
from boosttune.train.teacher.shards import (
    Continuation,
    cut_at_eos,
    missing_shards,
    pending_shards,
    shard_prompts,
    write_shard,
)

# Texts whose tokenisation differs between tokenizers: scripts, emoji, code, runs of spaces/tabs/newlines.
PROBE_TEXTS = (
    "Hello, world! How are you today?",
    "Grüße aus Köln: naïve café, 東京タワーは高い。Привет, мир! 🙂👍🏽 ١٢٣",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0:\n        pass  # }}]);",
    "a    b\t\t\tc\n\n\n   d      e  \u00a0 f",
    "1234567890 3.14159 0x1F 2026-12-01 e^{i\\pi}+1=0",
)
MAX_SPECIAL_PREFIX = 2  # tokens a server may put before a text prompt (a BOS, say) that the local tokenizer does not
MAX_SEGMENTATION_DIFFS = 1  # probes a server may split otherwise (same vocabulary): see check_tokenizer
# The server's request fields that map back to a config field (for errors the server reports).
_PARAM_FIELDS = {"logprobs": "teacher.topk_logprobs", "model": "teacher.model", "max_tokens": "teacher.max_new_tokens",
                 "temperature": "teacher.temperature", "top_p": "teacher.top_p", "seed": "optim.seed"}


class TeacherServerError(ValueError):
    """The server cannot serve as the teacher (unreachable, wrong model, other tokenizer, missing data).
    A ValueError, so that `boosttune train` prints it as one line naming the config field."""


@dataclass
class IdStats:
    """How the output token ids of the continuations were obtained."""

    exact: int = 0
    """Continuations whose ids the server returned."""
    retokenized: int = 0
    """Continuations re-tokenised from the server's text (the server returned no ids)."""
    roundtrip_differs: int = 0
    """Of the exact ones: how many a decode -> encode round trip would have changed."""
    eos_appended: int = 0
    """"stop" continuations whose ids came without the EOS token; it was put back."""

    def add(self, other: IdStats) -> None:
        for name in ("exact", "retokenized", "roundtrip_differs", "eos_appended"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        source = ("server" if not self.retokenized else "retokenized" if not self.exact else "retokenized+server")
        return {"source": source, "exact": self.exact, "retokenized": self.retokenized,
                "roundtrip_differs": self.roundtrip_differs, "eos_appended": self.eos_appended}


@dataclass
class ServerInfo:
    """What preflight learned about the server."""

    url: str
    model: str
    owned_by: str
    tokenizer_check: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.owned_by or 'the server'} at {self.url} (model {self.model!r})"


class OpenAITeacher:
    """A client of one OpenAI-compatible completions server, asking for the LLM's continuations.

    ``complete`` may be called from many threads at once (httpx clients are thread-safe).
    """

    def __init__(self, cfg: TeacherConfig, tokenizer, eos_ids: frozenset[int], *, timeout: float = 600.0,
                 retries: int = 6, backoff: float = 0.5, max_backoff: float = 30.0, connect_retries: int = 2):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos = eos_ids
        self.url = cfg.endpoint.strip().rstrip("/")
        self.retries, self.backoff, self.max_backoff, self.connect_retries = retries, backoff, max_backoff, connect_retries
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=cfg.concurrency + 2))
        self.info = ServerInfo(url=self.url, model=cfg.model, owned_by="")

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------------------------ HTTP
    def _fail(self, msg: str, where: str = "teacher.endpoint") -> TeacherServerError:
        return TeacherServerError(f"{where}: {msg}")

    def _request(self, method: str, path: str, body: dict | None = None, retries: int | None = None,
                 optional: bool = False) -> dict | None:
        """JSON of ``method path``; transient failures retried with backoff. ``optional``: None on 404/405/501
        (an endpoint the server does not have)."""
        retries = self.retries if retries is None else retries
        last = ""
        for attempt in range(retries + 1):
            wait_s = min(self.backoff * 2**attempt, self.max_backoff) * (1 + 0.25 * random.random())
            try:
                r = self.http.request(method, path, json=body)
            except httpx.TransportError as e:  # refused, reset, timed out: maybe the server is restarting
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code < 400:
                    try:
                        return r.json()
                    except ValueError:
                        raise self._fail(f"{method} {self.url}{path} answered {r.status_code} with a body that is "
                                         f"not JSON: {r.text[:200]!r}") from None
                if optional and r.status_code in (404, 405, 501):
                    return None
                if r.status_code != 429 and r.status_code < 500:
                    raise self._http_error(r, method, path)
                last = f"HTTP {r.status_code}: {_message(r)}"
                retry_after = r.headers.get("retry-after", "")
                if retry_after.isdigit():
                    wait_s = max(wait_s, min(float(retry_after), self.max_backoff))
            if attempt < retries:
                time.sleep(wait_s)
        raise self._fail(f"{method} {self.url}{path} failed {retries + 1} times ({last}); is the server up? "
                         "Shards already written are kept: re-run to continue")

    def _http_error(self, r: httpx.Response, method: str, path: str) -> TeacherServerError:
        msg = _message(r)
        if r.status_code in (401, 403):
            return self._fail(f"{self.url} refused the request ({r.status_code}: {msg}); put the server's API key in "
                              f"the environment variable {self.cfg.api_key_env or '(none set)'}", "teacher.api_key_env")
        param = _error_param(r)
        where = _PARAM_FIELDS.get(param or "", "teacher.endpoint")
        hint = " (is the base URL right? it usually ends in /v1)" if r.status_code == 404 and where == "teacher.endpoint" else ""
        return self._fail(f"{self.info.name if self.info.owned_by else self.url} answered {method} {path} with "
                          f"{r.status_code}: {msg}{hint}", where)

    # ------------------------------------------------------------------------------- preflight
    def preflight(self, first_prompt: Sequence[int]) -> ServerInfo:
        """Model, tokenizer and one real request checked; raises :class:`TeacherServerError`."""
        self.connect()
        self.info.tokenizer_check = self.check_tokenizer()
        _, ids = self.complete(first_prompt, max_tokens=min(2, self.cfg.max_new_tokens), seed=0)
        if ids.retokenized and self.info.tokenizer_check["split_differently"]:
            raise self._fail(f"{self.info.name} returns no output token ids, and its tokenizer splits some text "
                             "otherwise than the LLM's: re-tokenised outputs would not be the LLM's tokens. Use a "
                             "server that returns token ids (vLLM with return_token_ids, llama-server, boosttune serve)")
        return self.info

    def connect(self) -> None:
        """The server answers ``GET /models`` and serves ``teacher.model`` (empty: its first)."""
        models = self._request("GET", "/models", retries=self.connect_retries)
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not data:
            raise self._fail(f"GET {self.url}/models lists no model ({str(models)[:200]}); is this an OpenAI-compatible "
                             "server's base URL (usually ending in /v1)?")
        ids = [str(m.get("id")) for m in data if isinstance(m, dict)]
        if self.cfg.model and self.cfg.model not in ids:
            raise self._fail(f"the server at {self.url} serves {ids}, not {self.cfg.model!r}; set teacher.model to "
                             "one of them (or leave it empty for the first)", "teacher.model")
        self.info.model = self.cfg.model or ids[0]
        card = next(m for m in data if isinstance(m, dict) and str(m.get("id")) == self.info.model)
        self.info.owned_by = str(card.get("owned_by") or "")

    def check_tokenizer(self) -> dict:
        """Refuse a server whose tokenizer is not the LLM's; returns what was checked.

        Where the server shows its token ids for a probe (``prompt_token_ids``, ``/tokenize``), they must
        spell the probe in the local vocabulary (decoded locally to the same text: same ids for the same
        strings), and split it as the local tokenizer does on all probes but ``MAX_SEGMENTATION_DIFFS``:
        tokenizer implementations disagree on rare pre-tokenisation cases (llama-server splits
        SmolLM2's " ١" after an emoji into two tokens where HF's tokenizer has one: measured here),
        which is harmless while ids go both ways, as they do here. A different vocabulary or other
        merges show on most probes. Where only ``usage.prompt_tokens`` is known, the counts must equal
        the local ones, up to a constant number of special tokens the server puts first (a BOS).
        """
        offsets, by, resplit, specials = set(), set(), [], set(self.tokenizer.all_special_ids)
        for text in PROBE_TEXTS:
            plain = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            body = {"model": self.info.model, "prompt": text, "max_tokens": 1, "temperature": 0.0,
                    **self._id_fields()}
            r = self._request("POST", "/completions", body)
            choice = _choice(r) or {}
            n = (r.get("usage") or {}).get("prompt_tokens")
            shown: list[tuple[str, list[int]]] = []
            if isinstance(choice.get("prompt_token_ids"), list):
                ids = list(choice["prompt_token_ids"])
                n, lead = len(ids), 0
                while lead < min(MAX_SPECIAL_PREFIX, len(ids)) and ids[lead] in specials:
                    lead += 1  # a BOS the server puts before text prompts
                shown.append(("prompt_token_ids", ids[lead:]))
            tok = self._request("POST", _root(self.url) + "/tokenize", {"model": self.info.model, "prompt": text,
                                "content": text, "add_special_tokens": False, "add_special": False}, optional=True)
            if isinstance(tok, dict) and isinstance(tok.get("tokens"), list) and all(isinstance(t, int) for t in tok["tokens"]):
                shown.append(("/tokenize", list(tok["tokens"])))
            for how, ids in shown:
                by.add(how)
                if self.tokenizer.decode(ids) != self.tokenizer.decode(plain):
                    raise self._tokenizer_error(text, f"its ids {ids[:8]}... ({how}) spell other text in the "
                                                      "LLM's vocabulary")
                if ids != plain and text not in resplit:
                    resplit.append(text)
            if not shown:
                if not isinstance(n, int):
                    raise self._fail(f"{self.info.name} reports neither prompt token ids nor usage.prompt_tokens; "
                                     "boosttune cannot check that it tokenises as the LLM does")
                by.add("usage.prompt_tokens")
                offsets.add(n - len(plain))
                if not 0 <= n - len(plain) <= MAX_SPECIAL_PREFIX or len(offsets) > 1:
                    raise self._tokenizer_error(text, f"it is {n} tokens there (usage.prompt_tokens), {len(plain)} here")
            elif isinstance(n, int):
                offsets.add(n - len(plain))
        if len(resplit) > MAX_SEGMENTATION_DIFFS:
            raise self._tokenizer_error(resplit[0], f"the server splits {len(resplit)} of {len(PROBE_TEXTS)} probes "
                                                    "into other tokens (other merges or pre-tokenisation)")
        return {"probes": len(PROBE_TEXTS), "by": sorted(by), "split_differently": len(resplit),
                "special_prefix": max(offsets, default=0)}

    def _tokenizer_error(self, text: str, what: str) -> TeacherServerError:
        shown = text if len(text) < 40 else text[:37] + "..."
        return self._fail(
            f"{self.info.name} tokenises differently from the LLM's tokenizer ({getattr(self.tokenizer, 'name_or_path', '')}): "
            f"probe {shown!r}: {what}. Serve the model that llm.ref names (same tokenizer), or set llm.ref to the "
            "model the server serves")

    # ------------------------------------------------------------------------------ generation
    def _id_fields(self) -> dict:
        """Request fields that make the server return token ids (only what the server understands)."""
        if self.info.owned_by == "llamacpp":
            return {"return_tokens": True, "verbose": True}
        return {"return_token_ids": True}

    def complete(self, prompt: Sequence[int], max_tokens: int | None = None, seed: int = 0) -> tuple[Continuation, IdStats]:
        """The LLM's continuation of one token-id prompt, and how its ids were obtained."""
        cfg = self.cfg
        body: dict[str, Any] = {"model": self.info.model, "prompt": list(prompt),
                                "max_tokens": max_tokens or cfg.max_new_tokens, "temperature": cfg.temperature,
                                "top_p": cfg.top_p, **self._id_fields()}
        if cfg.temperature > 0:
            body["seed"] = seed
        if cfg.topk_logprobs:
            body["logprobs"] = cfg.topk_logprobs
            body["return_tokens_as_token_ids"] = True  # vLLM: top-k keyed "token_id:N" rather than by text
        r = self._request("POST", "/completions", body)
        used = (r.get("usage") or {}).get("prompt_tokens")
        if isinstance(used, int) and used != len(prompt):
            raise self._fail(f"{self.info.name} read {used} prompt tokens for a prompt of {len(prompt)} token ids (it "
                             "adds or drops tokens, e.g. a BOS), so its continuations would not be of these prompts")
        return self._continuation(r, body["max_tokens"])

    def _continuation(self, r: dict, max_tokens: int) -> tuple[Continuation, IdStats]:
        choice = _choice(r)
        if not isinstance(choice, dict):
            raise self._fail(f"{self.info.name} answered without choices: {str(r)[:200]}")
        stats = IdStats()
        ids = choice.get("token_ids")
        if ids is None:
            ids = (r.get("__verbose") or {}).get("tokens") if isinstance(r.get("__verbose"), dict) else None
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            stats.exact = 1
            ids = list(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) != [t for t in ids if t not in self.eos]:
                stats.roundtrip_differs = 1
        else:
            stats.retokenized = 1
            ids = list(self.tokenizer(choice.get("text") or "", add_special_tokens=False)["input_ids"])[:max_tokens]
        finish = choice.get("finish_reason")
        ids, cut = cut_at_eos(ids, self.eos)
        if finish == "stop" and cut != "stop":
            if len(ids) >= max_tokens:
                raise self._fail(f"{self.info.name} stopped (finish_reason 'stop') after {len(ids)} tokens without "
                                 "an EOS token among them; was a stop string configured on the server?")
            reason = choice.get("stop_reason")
            ids.append(reason if isinstance(reason, int) and reason in self.eos else self._eos_id())
            stats.eos_appended, cut = 1, "stop"
        elif finish not in ("stop", "length"):
            raise self._fail(f"{self.info.name} ended a continuation with finish_reason {finish!r} "
                             "(expected 'stop' or 'length')")
        cont = Continuation(ids, cut)
        if self.cfg.topk_logprobs:
            cont.topk_ids, cont.topk_logprobs = self._topk(choice.get("logprobs"), len(ids))
        return cont, stats

    def _eos_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos in self.eos else min(self.eos)

    def _topk(self, lp: Any, n: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k ids and log-probs per output position from the two layouts that carry ids."""
        k = self.cfg.topk_logprobs
        where = "teacher.topk_logprobs"
        if not isinstance(lp, dict):
            raise self._fail(f"{self.info.name} returned no 'logprobs' for logprobs={k}; this server cannot give "
                             "top-k log-probs: set teacher.topk_logprobs=0 (and optim.loss=ce)", where)
        rows: list[list[tuple[int, float]]] = []
        if isinstance(lp.get("content"), list):  # llama-server: [{id, logprob, top_logprobs: [{id, logprob}]}]
            for pos in lp["content"]:
                rows.append([(int(e["id"]), float(e["logprob"])) for e in pos.get("top_logprobs") or []])
        elif isinstance(lp.get("top_logprobs"), list):  # OpenAI legacy: [{token: logprob}], vLLM "token_id:N" keys
            for pos in lp["top_logprobs"]:
                row = []
                for key, value in (pos or {}).items():
                    if not str(key).startswith("token_id:"):
                        raise self._fail(f"{self.info.name} names its top-k tokens by text ({key!r}), not by id; "
                                         "boosttune needs ids (vLLM gives them with return_tokens_as_token_ids, "
                                         "llama-server always): set teacher.topk_logprobs=0 for this server", where)
                    row.append((int(str(key)[len("token_id:"):]), float(value)))
                rows.append(row)
        else:
            raise self._fail(f"{self.info.name} returned 'logprobs' in a layout boosttune does not read "
                             f"({sorted(lp)}); set teacher.topk_logprobs=0 for this server", where)
        if len(rows) < n or any(len(r) < k for r in rows[:n]):
            short = min((len(r) for r in rows[:n]), default=0)
            raise self._fail(f"{self.info.name} returned top-k log-probs for {len(rows)} positions (at least {short} "
                             f"per position) where {n} positions x {k} are needed; refusing to write incomplete shards",
                             where)
        ids, lps = [], []
        for row in rows[:n]:
            best = sorted(row, key=lambda e: -e[1])[:k]
            ids.append([t for t, _ in best])
            lps.append([v for _, v in best])
        return ids, lps

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], pool: ThreadPoolExecutor,
                 on_done=None) -> tuple[list[Continuation], IdStats]:
        """Continuations of ``prompts`` in prompt order, ``cfg.concurrency`` requests in flight."""
        futures = {pool.submit(self.complete, p, None, s): i for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))}
        out: list[Continuation | None] = [None] * len(prompts)
        stats = IdStats()
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                if f.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise f.exception()
                cont, s = f.result()
                out[futures[f]] = cont
                stats.add(s)
                if on_done is not None:
                    on_done(cont)
        return out, stats  # type: ignore[return-value]


def _choice(r: Any) -> dict | None:
    choices = r.get("choices") if isinstance(r, dict) else None
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None


def _root(url: str) -> str:
    """The path to go from the base URL (…/v1) to the server's root, where /tokenize lives: '..' in
    httpx terms is not supported, so an absolute URL."""
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:300]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)[:500]
    if isinstance(body, dict) and "message" in body:  # vLLM's older ErrorResponse, FastAPI's detail
        return str(body["message"])[:500]
    return str(body)[:300]


def _error_param(r: httpx.Response) -> str | None:
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return None
    return err.get("param") if isinstance(err, dict) else None


def check_endpoint(cfg: TeacherConfig, tokenizer) -> ServerInfo:
    """The server's model and tokenizer checked (no generation): what `boosttune train` does before it
    loads the LLM's weights, so that a wrong endpoint fails in seconds."""
    teacher = OpenAITeacher(cfg, tokenizer, frozenset())
    try:
        teacher.connect()
        teacher.info.tokenizer_check = teacher.check_tokenizer()
        return teacher.info
    finally:
        teacher.close()


def prompt_seed(seed: int, index: int) -> int:
    """A sampling teacher's seed for prompt ``index`` of the run (the same on every resume)."""
    return (seed * 1_000_003 + index) % (2**31 - 1)


def run_openai_teacher(
    tokenizer, prompts: Sequence[TrainPrompt], cfg: TeacherConfig, run: RunDir, eos_ids: frozenset[int],
    rank: int = 0, world: int = 1, seed: int = 0,
) -> dict:
    """Write this rank's missing shards from the server's answers; returns what this call generated."""
    run.teacher_dir.mkdir(parents=True, exist_ok=True)
    todo = pending_shards(run, len(prompts), cfg.shard_size, rank, world)
    result = {"shards_written": 0, "tokens": 0, "seconds": 0.0, "backend": "openai", "tokens_per_s": 0.0,
              "endpoint": cfg.endpoint, "token_ids": IdStats().as_dict()}
    if not todo:  # nothing to ask: a finished phase resumes without the server
        return result
    teacher = OpenAITeacher(cfg, tokenizer, eos_ids)
    try:
        info = teacher.preflight(prompts[todo[0] * cfg.shard_size].input_ids)
        tokens, t0, ids = 0, time.perf_counter(), IdStats()
        n_todo = sum(len(shard_prompts(prompts, k, cfg.shard_size)) for k in todo)
        bar = progress(total=n_todo, desc=f"teacher[rank {rank}, openai {info.owned_by or 'server'}]", unit="prompt")

        def done(c: Continuation) -> None:
            nonlocal tokens
            tokens += len(c.output_ids)
            bar.set_postfix(tok=tokens, tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
            bar.update(1)

        with ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="teacher-http") as pool:
            for k in todo:
                lo = k * cfg.shard_size
                shard = shard_prompts(prompts, k, cfg.shard_size)
                conts, s = teacher.generate([p.input_ids for p in shard],
                                            [prompt_seed(seed, lo + i) for i in range(len(shard))], pool, done)
                ids.add(s)
                write_shard(run.teacher_shard(k), shard, conts, cfg.topk_logprobs)
        bar.close()
    finally:
        teacher.close()
    secs = time.perf_counter() - t0
    result.update(shards_written=len(todo), tokens=tokens, seconds=secs, token_ids=ids.as_dict(),
                  tokens_per_s=tokens / secs if secs > 0 and tokens else 0.0,
                  server={"model": info.model, "owned_by": info.owned_by, "tokenizer_check": info.tokenizer_check})
    return result


class OpenAIBackend(TeacherBackend):
    """``teacher.backend: openai``: an OpenAI-compatible completions server at ``teacher.endpoint``."""

    def preflight(self, llm_ref: str, run: RunDir) -> None:
        """The server's model and tokenizer checked before the LLM's weights load, unless every shard
        is written already (a finished phase resumes without the server)."""
        info = run.prompts_info()
        if info is not None and not missing_shards(run, info["count"], self.cfg.shard_size):
            return
        check_endpoint(self.cfg, AutoTokenizer.from_pretrained(resolve_model_path(llm_ref)))

    def run(self, model, tokenizer, prompts: Sequence[TrainPrompt], run: RunDir, eos_ids: frozenset[int], *,
            rank: int = 0, world: int = 1, seed: int = 0, features: bool = False) -> dict:
        """See :meth:`TeacherBackend.run`; ``model`` and ``features`` are unused (the server has the LLM)."""
        return run_openai_teacher(tokenizer, prompts, self.cfg, run, eos_ids, rank=rank, world=world, seed=seed)
