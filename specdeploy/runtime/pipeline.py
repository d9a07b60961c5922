"""The embeddable API: ``Pipeline.load(artifact_dir)``, ``generate``, ``stream``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..contract import Manifest
from ..engines.even import EvenTokens
from ..engines.providers import Provider
from ..values import is_integer, short
from .answer_lengths import AnswerLengths
from .artifact import open_artifact
from .cache import EXPORTED, cache_bytes, plan_batch, plan_capacity
from .calibration import Calibration, RememberedCosts, machine_key
from .chat import ChatTemplate, TextCodec
from .config import ConfigError, GenerationConfig, checked_threads
from .cost_policy import Costs
from .decoder import Generation
from .divergence import first_divergence
from .exact import check_exact
from .policies import Policy
from .prefix_cache import DEFAULT_BYTES as DEFAULT_PREFIX_BYTES
from .prefix_cache import PrefixCache
from .registry import USE_A_MODEL, check_drafter, drafter_name, policy_of, speculation
from .results import GenerationError, GenerationResult, StreamChunk
from .rows import RowResult, RowSettings
from .stops import StopStrings
from .streaming import TextStream
from .suffix import SuffixIndex
from .suffix_store import DEFAULT_SCOPE, FROM_SCOPE, FromScope, SuffixFile, SuffixStore, row_scopes
from .telemetry import FinishReason

# default request ids ("req-N"), unique within the process: a suffix index keeps a finished request's text by its id,
# and pipelines may share one store (a new pipeline a request, as `specdeploy generate` and tools.replay run them)
_REQUEST_NUMBERS = itertools.count()


class Pipeline:
    """A loaded artifact: tokenizer, target engine and (optionally) draft engine.

    - ``Pipeline.load(dir)``, ``close()`` (or ``with``): open and release the engines.
    - ``generate(prompts, config)``, ``stream(prompt, config)``, ``chat(messages, config)``: whole requests.
    - ``start(prompts, config)``: a batch in flight (``Generation``) that a front end steps, joins and merges;
      ``check_request`` admits one request before it is queued, ``check_config`` its settings alone; ``result``
      turns a finished row into a ``GenerationResult``; ``policy_for``, ``warm_up``.
    - ``encode``, ``decode``, ``chat_prompt``: text and token ids; ``cache_bytes``: a batch's KV memory;
      ``first_divergence``: where two greedy outputs part.
    - The suffix indexes by scope (``suffix_store``; ``save_suffix_file``), the prefix cache (``prefix_cache``), the
      engines' cost tables (``calibration``; the default mode's: ``costs``) and how long its answers run (``answers``),
      shared by its requests.
    """

    def __init__(self, manifest: Manifest, tokenizer, target, draft=None, directory: Path | None = None,
                 max_cache_bytes: int | None = None, chat_template: ChatTemplate | None = None,
                 remembered_costs: RememberedCosts | None = None, suffix_store: SuffixStore | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_BYTES):
        self.manifest, self.target, self.draft = manifest, target, draft
        # prompts to token ids and back: the tokenizer and its chat template
        self.codec = TextCodec(tokenizer, chat_template or ChatTemplate({}), target.spec.vocab_size, target.spec.capacity)
        self.directory = directory
        if max_cache_bytes is not None and (not is_integer(max_cache_bytes) or max_cache_bytes < 1):
            raise ConfigError(f"max_cache_bytes: got {short(max_cache_bytes)}; expected an integer >= 1, or None")
        self.max_cache_bytes = max_cache_bytes
        # what each call costs on this machine, by mode: the engines', so shared by every request's cost policy; and how
        # long its answers run, which a catch-up is judged by (``Generation.to_come``)
        self.calibration = Calibration(remembered_costs)
        # exact mode's target: every call an even number of tokens a row, or the target itself where its calls compute
        # a position alike whatever their size (``Engine.rows_alike``: OpenVINO's CPU kernels at FP32)
        self._exact_target = target if target.rows_alike else EvenTokens(target)
        # the texts of the requests this pipeline finished, which later requests draft from (``suffix_index``)
        self.suffix_store = suffix_store if suffix_store is not None else SuffixStore()
        self.suffix_file: SuffixFile | None = None  # where ``save_suffix_file`` writes (``load(suffix_file=...)``)
        if not is_integer(prefix_cache_bytes) or prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes: got {short(prefix_cache_bytes)}; expected an integer >= 0 (0: none)")
        # the K/V of finished requests' texts, which later prompts of their scope that start alike reuse
        self.prefix_cache = PrefixCache(int(prefix_cache_bytes))
        self.suffix_store.on_evict(self._forget_scope)  # a scope the store lets go keeps no K/V either

    @classmethod
    def load(cls, directory: str | Path, provider: str | Provider = "cpu", threads: int | None = None,
             verify_hashes: bool = True, max_cache_bytes: int | None = None, remember_costs: bool = False,
             suffix_file: str | Path | None = None, suffix_store: SuffixStore | None = None, log=None,
             prefix_cache_bytes: int = DEFAULT_PREFIX_BYTES, *,
             draft_provider: str | Provider | None = None) -> Pipeline:
        """Load an artifact dir written by ``specdeploy export``.

        Every file's sha256 is checked against the manifest before any byte reaches ONNX Runtime,
        unless ``verify_hashes=False`` is passed explicitly. ``provider``: the execution provider, a word ("cpu",
        "cuda", "tensorrt", "openvino") or a ``Provider`` with its options (OpenVINO's device and precision);
        a graph it would run only in pieces is refused (``ProviderError``). ``draft_provider``: the draft model's, where it
        differs from the target's (None: ``provider``): a draft whose calls are mostly one token may run quicker on
        another provider than the target's verifications do (docs/results/openvino/); the cost policy prices each
        model's calls as its own provider ran them. ``max_cache_bytes`` caps the KV-cache
        memory one batch may allocate (target and draft together); a batch over it is refused.
        ``remember_costs`` starts the first request's policy from what the last process measured on this
        artifact, providers and thread count, and keeps what this one measures (``calibration``; the default mode's
        table and exact mode's): for short-lived processes such as ``specdeploy generate``; a long-lived one learns
        them in its first request.
        ``suffix_file``: a file of earlier requests' texts to draft from (``save_suffix_file`` writes it); one that
        is corrupt, too large or for another tokenizer is refused in one line (``log``, default: a warning) and the
        pipeline starts with an empty index. ``suffix_store``: the indexes to use (bounds, scopes).
        ``prefix_cache_bytes``: memory for finished requests' K/V, which later prompts of the same suffix-index scope
        that start alike reuse instead of prefilling (``PrefixCache``; 0: none).
        """
        threads = checked_threads(threads)  # before any work: too many abort the process inside ONNX Runtime
        directory = Path(directory)
        manifest, tokenizer, chat, target, draft = open_artifact(directory, provider, threads, verify_hashes,
                                                                 draft_provider)
        remembered = (RememberedCosts(machine_key(directory, provider, threads, draft_provider)) if remember_costs
                      else None)
        pipeline = cls(manifest, tokenizer, target, draft, directory, max_cache_bytes, chat, remembered, suffix_store,
                       prefix_cache_bytes)
        if suffix_file is not None:
            spec = target.spec
            pipeline.suffix_file = SuffixFile(pipeline.suffix_store, suffix_file, spec.tokenizer_fingerprint,
                                              spec.vocab_size)
            pipeline.suffix_file.read(log)
        return pipeline

    def save_suffix_file(self) -> Path | None:
        """Write the suffix indexes to the file ``load(suffix_file=...)`` named (``SuffixFile.write``); returns its path,
        or None where there is none or it was refused when read."""
        return self.suffix_file.write() if self.suffix_file is not None else None

    def _forget_scope(self, scope: str) -> None:
        self.prefix_cache.forget(scope)

    def close(self) -> None:
        """Close the engines (their sessions and bound buffers) and let go of the suffix store (which may outlive this
        pipeline: it no longer tells this one what it evicts); later requests fail. Closing twice is harmless."""
        self.suffix_store.off_evict(self._forget_scope)
        for engine in (self.draft, self.target):
            if engine is not None:
                engine.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cache_bytes(self, batch: int, capacity: int, speculative: bool = True) -> dict[str, int]:
        """KV-cache bytes a batch of ``batch`` rows of ``capacity`` slots allocates, per model and in total.

        ``capacity`` already holds the speculative slots (prompt + max_new_tokens + k + 1).
        """
        return cache_bytes(_model_specs(self.target, self.draft if speculative else None), batch, capacity)

    @property
    def costs(self) -> Costs:
        """The default mode's cost table (``calibration``)."""
        return self.calibration.costs

    @property
    def answers(self) -> AnswerLengths:
        """How long this pipeline's latest answers ran (``calibration``), which a draft catch-up is repaid over."""
        return self.calibration.answers

    def warm_up(self, k: int, prompt_tokens: int = 0, exact: bool = False) -> float:
        """Measure the shapes a request of at most ``k`` drafts calls, after a prefill of ``prompt_tokens`` (a server's
        chunk), into ``exact`` mode's cost table or the default's (``Calibration.warm_up``); returns the seconds taken.
        ``start`` runs it once per k and mode."""
        return self.calibration.warm_up(self._mode(exact)[0], self.draft, k, prompt_tokens, exact)

    tokenizer = property(lambda self: self.codec.tokenizer)
    chat_template = property(lambda self: self.codec.template)

    def encode(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Token ids [tokens] int64 of a prompt: text, or integer ids inside the vocabulary (``TextCodec.encode``)."""
        return self.codec.encode(prompt)

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, time_limit: float | None = None) -> list[int]:
        """Token ids of ``messages`` rendered with the tokenizer's chat template (``TextCodec.encode_chat``)."""
        return self.codec.encode_chat(messages, add_generation_prompt, tools, time_limit)

    def chat(self, messages: Sequence[dict], config: GenerationConfig | None = None) -> GenerationResult:
        """The assistant's reply to ``messages`` ([{"role": "system" | "user" | "assistant", "content": ...}])."""
        return self.generate([self.chat_prompt(messages)], config)[0]

    def start(self, prompts: Sequence[str | Sequence[int]], config: GenerationConfig,
              row_configs: Sequence[GenerationConfig] | None = None, capacity: int | None = None,
              suffix_index: SuffixIndex | None | FromScope = FROM_SCOPE, *, scope: str | None = DEFAULT_SCOPE,
              policy: Policy | None = None, request_ids: Sequence[str] | None = None, **listeners) -> Generation:
        """A batch in flight: call ``.step()`` until ``.done``. Validates everything before any work.

        ``config`` sets the batch's speculation (k, drafter, policy); ``row_configs`` gives each prompt its own
        settings (default: ``config``'s), its ``k`` capping that row's drafts. A seeded row's tokens do not depend on
        its batch: prompt i of one config draws from stream i of the seed, a prompt with its own config from stream 0.
        ``capacity`` fixes the cache slots per row (at least what the rows need), so that batches started
        apart can be merged. ``scope``: the name of the scope whose kept K/V (``prefix_cache``) they reuse and keep
        theirs in (default: the pipeline's, ``DEFAULT_SCOPE``; None: no K/V of earlier requests), or one per prompt (a
        server's requests under different API keys). ``suffix_index``: the index of earlier requests' texts these draft
        from, and which theirs join when they finish (default: their scope's index in ``suffix_store``; None: their own
        text alone), or one per prompt; it never changes whose K/V they reuse. ``policy`` (default:
        ``policy_for(config)``), ``request_ids`` (default: req-N) and ``listeners`` (``joining``, ``on_verified``) go to
        the ``Generation``.
        """
        self.check_config(config)
        _check_prompt_list(prompts, "expected a non-empty list of prompts")
        mine = row_configs is not None
        row_configs = _row_configs(config, row_configs, len(prompts))
        if any(row.exact != config.exact for row in row_configs):
            raise ConfigError(f"row_configs: exact={not config.exact} in a batch of exact={config.exact}; exact mode is "
                              "the batch's (its target calls), so every row's config must agree with config's")
        ids = [self.check_request(prompt, row, capacity=capacity, k=config.max_drafts)
               for prompt, row in zip(prompts, row_configs)]
        scopes = row_scopes(self.suffix_store, suffix_index, scope, len(prompts))
        # checked: what is built from here on is the batch's own
        target, costs = self._mode(config.exact)
        policy, drafter = speculation(config, self.draft, costs, policy)
        longest = max(row_configs, key=lambda c: c.max_new_tokens)
        specs = _model_specs(self.target, self.draft if drafter.uses_model else None)
        # the batch's slots a row (each row fits them alone: ``check_request``) and its caches' memory
        needed = plan_batch([len(i) for i in ids], replace(config, max_new_tokens=longest.max_new_tokens),
                            self._capacity_limit, specs, self.max_cache_bytes, capacity=capacity)
        request_ids = list(request_ids) if request_ids is not None else [f"req-{next(_REQUEST_NUMBERS)}" for _ in ids]
        # one config for all: prompt i draws from stream i of its seed; a prompt with its own config is its own request
        settings = [self._row_settings(row, 0 if mine else i, index, name)
                    for i, (row, (index, name)) in enumerate(zip(row_configs, scopes))]
        if config.speculative and not self.calibration.warmed(config.k, config.exact):
            self.warm_up(config.k, exact=config.exact)
        return Generation(target, drafter, policy, config, ids, request_ids, capacity=capacity or needed,
                          settings=settings, prefixes=self.prefix_cache, answers=self.calibration.answers, **listeners)

    @property
    def _capacity_limit(self) -> int:
        """Cache slots a row may have at most: the smallest capacity the artifact's models were exported with."""
        return min(spec.capacity for spec in self.manifest.models.values())

    def check_request(self, prompt: str | Sequence[int], config: GenerationConfig, *, capacity: int | None = None,
                      k: int | None = None, why: str | None = None) -> np.ndarray:
        """One request checked as ``start`` admits it, with no engine call and no cache: its prompt (text, or ids
        inside the vocabulary: ``encode``), its settings (a GenerationConfig whose stop ids are inside the vocabulary,
        exact mode only where the target can give it)
        and its room: the prompt, ``config.max_new_tokens`` and the ``k`` + 1 slots a verification writes (``k``: the
        batch's most drafts, default ``config``'s) within ``capacity`` slots a row (default: the artifact's;
        ``why`` says where a given one comes from, ``cache.plan_capacity``'s words). Returns the prompt's token ids
        [tokens] int64; raises ConfigError or CapacityError naming what is refused. A front end calls it before it
        queues a request (the server's intake), so that a refusal comes before anything is allocated for it."""
        self.check_config(config)
        limit = _checked_capacity(capacity, self._capacity_limit)
        ids = self.encode(prompt)
        plan_capacity([len(ids)], config.max_new_tokens, config.max_drafts if k is None else k, capacity or limit,
                      why=why or (EXPORTED if capacity is None else "capacity is {limit} slots a row (as asked)"))
        return ids

    def check_config(self, config: GenerationConfig) -> None:
        """ConfigError for settings this artifact cannot decode with, before any work and building nothing: not a
        GenerationConfig, stop ids outside the vocabulary, exact mode on a target that cannot give it
        (``exact.check_exact``), a drafter that needs the draft model it lacks (``registry.check_drafter``), more
        drafts than a model's ring of recurrent states can roll back."""
        if not isinstance(config, GenerationConfig):
            raise ConfigError(f"config: got {type(config).__name__}; expected a GenerationConfig")
        vocab = self.target.spec.vocab_size
        outside = [t for t in config.stop_token_ids if t >= vocab]
        if outside:
            raise ConfigError(f"stop_token_ids: got {short(outside)}; expected ids inside the vocabulary [0, {vocab})")
        drafts_with_model = drafter_name(config) in USE_A_MODEL
        for spec in _model_specs(self.target, self.draft if drafts_with_model else None).values():
            most = spec.max_drafts
            if config.max_drafts and most is not None and config.k > most:
                ring = min((s for s in spec.states if s.slots), key=lambda s: s.max_drafts)
                raise ConfigError(f"k: got {config.k}; the {spec.role} model keeps its recurrent state {ring.name!r} in a "
                                  f"ring of {ring.slots} positions, so a cycle verifies at most {most} drafts; use k <= "
                                  f"{most}")
        if config.exact:
            check_exact(self.target.spec)
        check_drafter(drafter_name(config), self.draft is not None)

    def policy_for(self, config: GenerationConfig) -> Policy:
        """A new request's policy; a cost policy prices by this pipeline's ``costs``, the engines' (acceptance
        belongs to the text: each request starts its own)."""
        return policy_of(config, self._mode(config.exact)[1])

    def _mode(self, exact: bool) -> tuple:
        """The target engine and the costs table of exact mode (``exact``) or of the default."""
        return (self._exact_target if exact else self.target), self.calibration.table(exact)

    def _row_settings(self, config: GenerationConfig, seed_stream: int = 0,
                     index: SuffixIndex | None = None, scope: str | None = None) -> RowSettings:
        """How one request decodes in any batch: ``config``'s settings, its stop strings on this tokenizer,
        its seed's stream (prompt i of one ``generate`` call draws from stream i), its scope's suffix index and the
        scope's name (whose kept K/V it reuses; None: none)."""
        return RowSettings(config=config, stop_check=StopStrings(config.stop, self.decode).check if config.stop else None,
                           seed_stream=seed_stream, index=index, scope=scope)

    def generate(self, prompts: str | Sequence[str | Sequence[int]], config: GenerationConfig | None = None,
                 batch_size: int | None = None, suffix_index: SuffixIndex | None | FromScope = FROM_SCOPE, *,
                 scope: str | None = DEFAULT_SCOPE) -> list[GenerationResult]:
        """One result per prompt, in order. Prompts run in batches of ``batch_size`` (default: all); ``suffix_index``
        and ``scope`` as ``start`` takes them."""
        config = config or GenerationConfig()
        if isinstance(prompts, str):
            prompts = [prompts]
        if batch_size is not None and (not is_integer(batch_size) or batch_size < 1):
            raise ConfigError(f"batch_size: got {short(batch_size)}; expected an integer >= 1, or None for all prompts")
        _check_prompt_list(prompts, "expected a prompt or a non-empty list of prompts")
        batch_size = int(batch_size or len(prompts))
        results = []
        for first in range(0, len(prompts), batch_size):
            run = self.start(prompts[first : first + batch_size], config, suffix_index=suffix_index, scope=scope)
            while not run.done:
                run.step()
            results += [self.result(request.result, request.settings.config) for request in run.requests]
        self.calibration.remember()  # what this pipeline's calls cost and its answers' lengths, for the next process
        return results

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               suffix_index: SuffixIndex | None | FromScope = FROM_SCOPE, *,
               scope: str | None = DEFAULT_SCOPE) -> Iterator[StreamChunk]:
        """Yield text and token chunks as each cycle commits them; the last chunk carries the result.

        The chunks' texts add up to the result's text: text that may still become part of a stop
        string is held back until it is known not to, and tokens are detokenized incrementally
        (``tokenizers``' ``DecodeStream``: an incomplete UTF-8 sequence waits for its next token).
        Raises ``GenerationError`` if the request fails. ``suffix_index`` and ``scope`` as ``start`` takes them.
        """
        config = config or GenerationConfig()
        run = self.start([prompt], config, suffix_index=suffix_index, scope=scope)
        text = TextStream(self.tokenizer, config.stop)
        row = run.results[0]
        while not run.done:
            for _, new in run.step():
                if row.finish_reason == FinishReason.ERROR:
                    raise GenerationError(f"{row.request_id}: {row.error}")
                if run.done:
                    result = self.result(row, config)
                    self.calibration.remember()
                    yield StreamChunk(text.finish(result.text), new, result)
                    return
                yield StreamChunk(text.push(new), new)
        if row.finish_reason == FinishReason.ERROR:  # failed before any token (prefill)
            raise GenerationError(f"{row.request_id}: {row.error}")

    def first_divergence(self, prompt: str | Sequence[int], reference: Sequence[int], other: Sequence[int],
                         config: GenerationConfig) -> dict | None:
        """Where greedy ``other`` leaves ``reference``: position and the target's margin there, as plain
        decoding of ``prompt`` under ``config`` computed it (``divergence.first_divergence``); None if nowhere."""
        return first_divergence(self._mode(config.exact)[0], self.encode(prompt), reference, other, config)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (integers inside the vocabulary), special tokens skipped (``TextCodec.decode``)."""
        return self.codec.decode(token_ids)

    def result(self, row: RowResult, config: GenerationConfig) -> GenerationResult:
        """A finished row as a result: its text on this tokenizer, tokens and stats (``GenerationResult.of``)."""
        return GenerationResult.of(row, config, self.decode)


def _row_configs(config: GenerationConfig, given, prompts: int) -> list[GenerationConfig]:
    """``start``'s ``row_configs`` as one GenerationConfig per prompt (default: ``config`` for each)."""
    row_configs = [config] * prompts if given is None else list(given)
    if len(row_configs) != prompts or not all(isinstance(c, GenerationConfig) for c in row_configs):
        raise ConfigError(f"row_configs: got {short(given)}; expected one GenerationConfig per prompt ({prompts})")
    return row_configs


def _checked_capacity(capacity, limit: int) -> int:
    """``start``'s ``capacity`` checked against the artifact's ``limit`` (which it returns); None: that limit."""
    if capacity is not None and (not is_integer(capacity) or not 1 <= capacity <= limit):
        raise ConfigError(f"capacity: got {short(capacity)}; expected an integer in [1, {limit}] (the artifact's)")
    return limit


def _model_specs(target, draft) -> dict:
    """The specs of the models whose caches a batch allocates: the target's, and the draft's if ``draft``."""
    return {"target": target.spec, **({"draft": draft.spec} if draft is not None else {})}


def _check_prompt_list(prompts, expected: str) -> None:
    """A list (or tuple) of at least one prompt; a bare string or bytes is not one."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError(f"prompts: got {short(prompts)}; {expected}")


