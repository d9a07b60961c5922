"""The embeddable API: ``Pipeline.load(artifact_dir)``, ``generate``, ``stream``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..contract import ContractError, Manifest, tokenizer_fingerprint, verify_files
from ..engines import load_engine
from .cache import CapacityError, KVCache, plan_capacity
from .config import ConfigError, GenerationConfig
from .decoder import Generation, RowResult
from .drafters import ModelDrafter, NoDrafter, PromptLookup
from .forward import forward_one, prefill
from .policies import make_policy
from .telemetry import CycleRecord, summarize


class GenerationError(RuntimeError):
    """A request that failed while decoding (an engine fault); other requests are unaffected."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens, prompt excluded
    stats: dict
    finish_reason: str = ""  # "eos", "length", "stop", or "error" (then ``error`` says why)
    records: list[CycleRecord] = field(default_factory=list)
    error: str = ""


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # tokens committed by this cycle
    result: GenerationResult | None = None  # set on the last chunk only


class Pipeline:
    """A loaded artifact: tokenizer, target engine and (optionally) draft engine."""

    def __init__(self, manifest: Manifest, tokenizer, target, draft=None, directory: Path | None = None,
                 max_cache_bytes: int | None = None):
        self.manifest, self.tokenizer, self.target, self.draft = manifest, tokenizer, target, draft
        self.directory = directory
        self.max_cache_bytes = max_cache_bytes
        self._ids = itertools.count()

    @classmethod
    def load(cls, directory: str | Path, provider: str = "cpu", threads: int | None = None,
             verify_hashes: bool = True, max_cache_bytes: int | None = None) -> Pipeline:
        """Load an artifact dir written by ``specdeploy export``.

        Every file's sha256 is checked against the manifest before any byte reaches ONNX Runtime,
        unless ``verify_hashes=False`` is passed explicitly. ``max_cache_bytes`` caps the KV-cache
        memory one batch may allocate (target and draft together); a batch over it is refused.
        """
        from tokenizers import Tokenizer

        directory = Path(directory)
        manifest = Manifest.read(directory)
        if verify_hashes:
            problems = verify_files(directory, manifest)
            if problems:
                raise ContractError(f"{directory}: artifact files do not match the manifest:\n  " + "\n  ".join(problems))
        tokenizer = Tokenizer.from_file(str(directory / manifest.tokenizer))
        fingerprint = tokenizer_fingerprint(tokenizer)
        for spec in manifest.models.values():
            if spec.tokenizer_fingerprint != fingerprint:
                raise ContractError(
                    f"{directory}: the {spec.role} model was exported with another tokenizer "
                    f"(fingerprint {spec.tokenizer_fingerprint[:12]}…, artifact tokenizer {fingerprint[:12]}…)"
                )
        draft_spec = manifest.draft
        if draft_spec is not None and draft_spec.vocab_size != manifest.target.vocab_size:
            raise ContractError(f"draft vocab {draft_spec.vocab_size} differs from target vocab {manifest.target.vocab_size}")
        target = load_engine(directory, manifest, "target", provider, threads)
        draft = load_engine(directory, manifest, "draft", provider, threads) if draft_spec else None
        return cls(manifest, tokenizer, target, draft, directory, max_cache_bytes)

    def cache_bytes(self, batch: int, capacity: int, speculative: bool = True) -> dict[str, int]:
        """KV-cache bytes a batch of ``batch`` rows of ``capacity`` slots allocates, per model and in total.

        ``capacity`` already holds the speculative slots (prompt + max_new_tokens + k + 1).
        """
        sizes = {"target": self.target.spec.cache_bytes(batch, capacity)}
        if speculative and self.draft is not None:
            sizes["draft"] = self.draft.spec.cache_bytes(batch, capacity)
        sizes["total"] = sum(sizes.values())
        return sizes

    def encode(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Token ids of a prompt (text, or ids checked against the vocabulary)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("prompt: got an empty string; expected at least one token")
            ids = np.array(self.tokenizer.encode(prompt, add_special_tokens=False).ids, np.int64)
        else:
            ids = np.asarray(list(prompt), dtype=np.int64)
            vocab = self.target.spec.vocab_size
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise ConfigError(f"prompt ids: range [{ids.min()}, {ids.max()}] outside the vocabulary [0, {vocab})")
        if ids.size == 0:
            raise ConfigError("prompt: encodes to no tokens; expected at least one")
        return ids

    def start(self, prompts: Sequence[str | Sequence[int]], config: GenerationConfig) -> Generation:
        """A batch in flight: call ``.step()`` until ``.done``. Validates everything before any work."""
        if not isinstance(config, GenerationConfig):
            raise ConfigError(f"config: got {type(config).__name__}; expected a GenerationConfig")
        if not prompts:
            raise ConfigError("prompts: got none; expected at least one prompt")
        ids = [self.encode(p) for p in prompts]
        drafter = self._drafter(config)
        limit = min(s.capacity for s in self.manifest.models.values())
        request_ids = [f"req-{next(self._ids)}" for _ in ids]
        stop_check = self._stop_check(config.stop) if config.stop else None
        if self.max_cache_bytes is not None:
            capacity = plan_capacity([len(i) for i in ids], config.max_new_tokens, config.k if config.speculative else 0,
                                     limit)
            sizes = self.cache_bytes(len(ids), capacity, speculative=config.drafter == "model" and config.speculative)
            if sizes["total"] > self.max_cache_bytes:
                detail = ", ".join(f"{role} {n / 2**20:.1f} MiB" for role, n in sizes.items() if role != "total")
                raise CapacityError(
                    f"KV caches for {len(ids)} rows x {capacity} slots need {sizes['total'] / 2**20:.1f} MiB ({detail}), "
                    f"over the limit of {self.max_cache_bytes / 2**20:.1f} MiB; use a smaller batch, fewer new tokens or k"
                )
        return Generation(self.target, drafter, make_policy(config.policy, config.k, config.confidence_threshold),
                          config, ids, request_ids, stop_check, k_limit=limit)

    def generate(self, prompts: str | Sequence[str | Sequence[int]], config: GenerationConfig | None = None,
                 batch_size: int | None = None) -> list[GenerationResult]:
        """One result per prompt, in order. Prompts run in batches of ``batch_size`` (default: all)."""
        config = config or GenerationConfig()
        if isinstance(prompts, str):
            prompts = [prompts]
        batch_size = batch_size or len(prompts)
        results = []
        for first in range(0, len(prompts), batch_size):
            run = self.start(prompts[first : first + batch_size], config)
            while not run.done:
                run.step()
            results += [self._result(row, run.prefill_seconds, config) for row in run.rows]
        return results

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None) -> Iterator[StreamChunk]:
        """Yield text and token chunks as each cycle commits them; the last chunk carries the result."""
        config = config or GenerationConfig()
        run = self.start([prompt], config)
        shown = ""
        row = run.rows[0]
        while not run.done:
            for _, new in run.step():
                text = self._cut_at_stop(self.decode(row.token_ids), config)
                # hold back a trailing partial UTF-8 sequence until the next token completes it
                visible = text[:-1] if text.endswith("\ufffd") and not run.done else text
                if row.finish_reason == "error":
                    raise GenerationError(f"{row.request_id}: {row.error}")
                if not run.done:
                    yield StreamChunk(visible[len(shown):], new)
                    shown = visible
                else:
                    result = self._result(row, run.prefill_seconds, config)
                    yield StreamChunk(result.text[len(shown):], new, result)

    def first_divergence(self, prompt: str | Sequence[int], reference: Sequence[int], other: Sequence[int],
                         config: GenerationConfig) -> dict | None:
        """Where greedy ``other`` leaves ``reference``, plain decoding's output of ``prompt`` under ``config``.

        Returns the position and the margin logit(reference token) - logit(other token) as plain
        decoding computed it: the target replays that request alone (prefill, then one token a call,
        in a cache of the capacity the request planned: compressed kernels give slightly different
        logits for other call shapes and capacities) up to the position. A small margin is a near-tie
        that the engine's arithmetic can tip (verifying K + 1 tokens at once is not bit-identical to
        decoding one: README, Exactness); a large one points at a bug. None when neither leaves the other.
        """
        position = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
        if position is None:
            return None
        prompt_ids = self.encode(prompt)
        ids = np.concatenate([prompt_ids, np.asarray(reference[:position], np.int64)])[None]
        prompt_end = len(prompt_ids) - 1  # plain decoding prefills all prompt tokens but the last
        capacity = plan_capacity([len(prompt_ids)], config.max_new_tokens, config.k if config.speculative else 0,
                                 self.target.spec.capacity)
        cache = KVCache(self.target.allocate_cache(1, capacity))
        prefill(self.target, cache, ids, np.array([prompt_end]))
        for at in range(prompt_end, ids.shape[1]):
            last, _ = forward_one(self.target, cache, np.ascontiguousarray(ids[:, at : at + 1]))
        a, b = int(reference[position]), int(other[position])
        return {"position": position, "reference_token": a, "other_token": b, "margin": float(last[0, 0, a] - last[0, 0, b])}

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _result(self, row: RowResult, prefill_seconds: float, config: GenerationConfig) -> GenerationResult:
        stats = summarize(row.records, seconds=row.decode_seconds)
        stats["prefill_s"] = prefill_seconds
        stats["prompt_tokens"] = int(len(row.prompt_ids))
        text = self._cut_at_stop(self.decode(row.token_ids), config)
        return GenerationResult(text, row.token_ids, stats, row.finish_reason, row.records, row.error)

    @staticmethod
    def _cut_at_stop(text: str, config: GenerationConfig) -> str:
        """Text up to (not including) the earliest stop string."""
        cuts = [text.find(s) for s in config.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def _drafter(self, config: GenerationConfig):
        if not config.speculative:
            return NoDrafter()
        if config.drafter == "prompt-lookup":
            return PromptLookup()
        if self.draft is None:
            raise ConfigError("drafter: 'model' needs a draft model, and this artifact has none; "
                              "use drafter='prompt-lookup' or 'none', or export with --draft")
        return ModelDrafter(self.draft)

    def _stop_check(self, stops: tuple[str, ...]):
        def check(previous: list[int], new: list[int]) -> int | None:
            """Fewest of the new tokens whose text completes a stop string; None if none does."""
            # one decode per cycle in the common case; the per-token search only once a stop appears
            if not any(s in self.decode(previous + new) for s in stops):
                return None
            for keep in range(1, len(new) + 1):
                text = self.decode(previous + new[:keep])
                if any(s in text for s in stops):
                    return keep
            return None

        return check
