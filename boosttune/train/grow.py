"""Growing the embedded prompt set: the LLM writes new requests modelled on the seed requests.

Each new request comes from one seed and its category ("Write one new request of the same kind"),
sampled (temperature 0.8, fixed seed) so that repeated seeds give different requests. Replies that
are empty, too short, or copies of a seed or of each other are dropped.
"""

from __future__ import annotations

import random

import torch

from boosttune.core.progress import progress
from boosttune.core.prompts import Prompt, encode_prompt
from boosttune.train.teacher.local import generate_batch, local_backend

_ASK = ("Here is an example of a {category} request someone might give an AI assistant:\n\n{seed}\n\n"
        "Write one new, different {category} request. Reply with the request only.")


def _clean(text: str) -> str:
    text = text.strip().strip('"').strip()
    for prefix in ("Request:", "New request:", "Here is a new request:"):
        if text.lower().startswith(prefix.lower()):
            text = text[len(prefix):].strip()
    return text


def grow_prompts(model, tokenizer, seeds: list[Prompt], n: int, eos_ids: frozenset[int], seed: int = 0,
                 batch_size: int = 32, max_new_tokens: int = 48, backend: str = "auto") -> list[Prompt]:
    """Up to ``n`` new requests written by the LLM (fewer if it repeats itself), sampled by
    ``backend`` ('batched', 'hf', or 'auto': batched where the LLM's attention allows it)."""
    if backend == "auto":
        backend = local_backend(model)
    rng = random.Random(seed)
    # a seed's asks side by side: the batched decoder reads each distinct ask once per batch
    picks = [seeds[i] for i in sorted(rng.randrange(len(seeds)) for _ in range(n))]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    seen = {s.text.strip().lower() for s in seeds}
    out: list[Prompt] = []
    torch.manual_seed(seed)
    for b in progress(range(0, n, batch_size), desc="grow prompts", unit="batch"):
        batch = picks[b:b + batch_size]
        asks = [encode_prompt(tokenizer, _ASK.format(category=p.category, seed=p.text)) for p in batch]
        conts = generate_batch(model, asks, max_new_tokens, 0.8, 0.95, pad, eos_ids, backend=backend)
        for p, c in zip(batch, conts, strict=True):
            text = _clean(tokenizer.decode(c.output_ids, skip_special_tokens=True))
            if len(text) >= 12 and text.lower() not in seen:
                seen.add(text.lower())
                out.append(Prompt(text=text, id=f"grown-{len(out) + 1}", category=p.category))
    return out
