"""The embeddable API: ``Pipeline.load(artifact_dir)``, ``generate``, ``stream``."""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..contract import PREFILL_CHUNK, Manifest
from ..engines.base import feed
from ..engines.providers import Provider
from ..values import is_integer, short
from .artifact import open_artifact
from .cache import EXPORTED, cache_bytes, plan_batch, plan_capacity, slots_needed
from .calibration import RememberedCosts, machine_key
from .chat import ChatTemplate
from .config import ConfigError, GenerationConfig, check_unicode, checked_threads, checked_token_ids
from .cost_policy import CostPolicy, Costs
from .decoder import Generation
from .divergence import first_divergence
from .drafters import Drafter
from .exact import ExactMode, check_exact
from .policies import CycleOutcome, Policy
from .prefix_cache import DEFAULT_BYTES as DEFAULT_PREFIX_BYTES
from .prefix_cache import PrefixCache
from .registry import policy_of, speculation
from .results import GenerationError, GenerationResult, StreamChunk
from .rows import RowResult, RowSettings
from .stops import StopStrings
from .streaming import TextStream
from .suffix import SuffixIndex
from .suffix_store import SHARED, SHARED_SCOPE, Shared, SuffixFileError, SuffixStore, row_scopes
from .telemetry import FinishReason, summarize

CATCHUP_TOKENS = 32  # a draft catch-up long enough to time a rate, not a call
CHARS_PER_TOKEN_BOUND = 64  # beyond this many characters a token each, a text's start is measured first


class Pipeline:
    """A loaded artifact: tokenizer, target engine and (optionally) draft engine.

    - ``Pipeline.load(dir)``, ``close()`` (or ``with``): open and release the engines.
    - ``generate(prompts, config)``, ``stream(prompt, config)``, ``chat(messages, config)``: whole requests.
    - ``start(prompts, config)``: a batch in flight (``Generation``) that a front end steps, joins and merges;
      ``check_request`` admits one request before it is queued, ``check_config`` its settings alone; ``result``
      turns a finished row into a ``GenerationResult``; ``policy_for``, ``drafter_for``, ``warm_up``.
    - ``encode``, ``decode``, ``chat_prompt``: text and token ids; ``cache_bytes``: a batch's KV memory;
      ``first_divergence``: where two greedy outputs part.
    - The suffix indexes (``suffix_store``, ``suffix_index``, ``load_suffix_file``, ``save_suffix_file``), the
      prefix cache (``prefix_cache``) and the engines' cost table (``costs``), shared by its requests.
    """

    def __init__(self, manifest: Manifest, tokenizer, target, draft=None, directory: Path | None = None,
                 max_cache_bytes: int | None = None, chat_template: ChatTemplate | None = None,
                 remembered_costs: RememberedCosts | None = None, suffix_store: SuffixStore | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_BYTES):
        self.manifest, self.tokenizer, self.target, self.draft = manifest, tokenizer, target, draft
        self.chat_template = chat_template or ChatTemplate({})
        bos = self.chat_template.bos_token
        # plain prompts start with BOS exactly when the tokenizer config says so (transformers' add_bos_token)
        self._bos = tokenizer.token_to_id(bos) if self.chat_template.add_bos_token and bos else None
        self.directory = directory
        if max_cache_bytes is not None and (not is_integer(max_cache_bytes) or max_cache_bytes < 1):
            raise ConfigError(f"max_cache_bytes: got {short(max_cache_bytes)}; expected an integer >= 1, or None")
        self.max_cache_bytes = max_cache_bytes
        self._ids = itertools.count()
        self._remembered = remembered_costs
        # what each call costs on this machine: the engines', so shared by every request's cost policy
        self.costs = (remembered_costs.recall() if remembered_costs else None) or Costs()
        # exact mode's target and costs (``exact``), its table recalled as the default's is
        self._exact = ExactMode(target, remembered_costs.recall("exact_costs") if remembered_costs else None)
        self._warmed: set[tuple[int, bool]] = set()  # the (k, exact) whose shapes ``warm_up`` has run
        # the texts of the requests this pipeline finished, which later requests draft from (``suffix_index``)
        self.suffix_store = suffix_store if suffix_store is not None else SuffixStore()
        self.suffix_file: Path | None = None  # where ``save_suffix_file`` writes (``load(suffix_file=...)``)
        if not is_integer(prefix_cache_bytes) or prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes: got {short(prefix_cache_bytes)}; expected an integer >= 0 (0: none)")
        # the K/V of finished requests' texts, which later prompts of their scope that start alike reuse
        self.prefix_cache = PrefixCache(int(prefix_cache_bytes))
        self.suffix_store.on_evict(self._forget_scope)  # a scope the store lets go keeps no K/V either
        self._warm_lock = threading.Lock()

    @classmethod
    def load(cls, directory: str | Path, provider: str | Provider = "cpu", threads: int | None = None,
             verify_hashes: bool = True, max_cache_bytes: int | None = None, remember_costs: bool = False,
             suffix_file: str | Path | None = None, suffix_store: SuffixStore | None = None, log=None,
             prefix_cache_bytes: int = DEFAULT_PREFIX_BYTES, *, suffix_cache: str | Path | None = None,
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
        that start alike reuse instead of prefilling (``PrefixCache``; 0: none). ``suffix_cache``: ``suffix_file``'s
        name before 0.5 (deprecated).
        """
        threads = checked_threads(threads)  # before any work: too many abort the process inside ONNX Runtime
        directory = Path(directory)
        manifest, tokenizer, chat, target, draft = open_artifact(directory, provider, threads, verify_hashes,
                                                                 draft_provider)
        remembered = (RememberedCosts(machine_key(directory, provider, threads, draft_provider)) if remember_costs
                      else None)
        pipeline = cls(manifest, tokenizer, target, draft, directory, max_cache_bytes, chat, remembered, suffix_store,
                       prefix_cache_bytes)
        if suffix_cache is not None:
            if suffix_file is not None:
                raise ConfigError("suffix_cache: got it with suffix_file; expected one (suffix_cache is the deprecated "
                                  "name of suffix_file)")
            warnings.warn("Pipeline.load(suffix_cache=...) is deprecated: use suffix_file=", DeprecationWarning,
                          stacklevel=2)
            suffix_file = suffix_cache
        if suffix_file is not None:
            pipeline.load_suffix_file(suffix_file, log)
        return pipeline

    @property
    def suffix_index(self) -> SuffixIndex:
        """The index of this pipeline's own scope (``SHARED_SCOPE``) in its store, which requests draft from by
        default (asked of the store each time: one the store evicted is never used again)."""
        return self.suffix_store.scope(SHARED_SCOPE)

    def _forget_scope(self, scope: str) -> None:
        self.prefix_cache.forget(scope)

    def load_suffix_file(self, path: str | Path, log=None) -> int:
        """Add the texts of the suffix index file at ``path`` (written by ``save_suffix_file``) to this pipeline's
        indexes, and save there from now on (a missing file is created then); returns the sequences read. A refused
        file is told in one line to ``log`` (default: ``warnings.warn``), leaves the indexes as they were, and is never
        written: it is the user's (a larger index, another artifact's, a file named by mistake), so this pipeline's
        index is saved nowhere unless ``save_suffix_file`` is given a path."""
        spec = self.target.spec
        try:
            read = self.suffix_store.load(Path(path), spec.tokenizer_fingerprint, spec.vocab_size)
        except SuffixFileError as exc:
            (log or (lambda message: warnings.warn(message, stacklevel=3)))(
                f"{exc}; starting with an empty index, which will not be saved ({path} is left as it is)")
            return 0
        self.suffix_file = Path(path)
        return read

    def save_suffix_file(self, path: str | Path | None = None) -> Path | None:
        """Write the suffix indexes to ``path`` (default: the file they were loaded from), atomically; None when
        there is nowhere to write."""
        path = Path(path) if path is not None else self.suffix_file
        if path is not None:
            spec = self.target.spec
            self.suffix_store.save(path, spec.tokenizer_fingerprint, spec.vocab_size)
        return path

    def load_suffix_cache(self, path: str | Path, log=None) -> int:
        """Deprecated since 0.5 (the file is a suffix index's, no cache's): ``load_suffix_file``."""
        warnings.warn("Pipeline.load_suffix_cache is deprecated: use load_suffix_file", DeprecationWarning, stacklevel=2)
        return self.load_suffix_file(path, log)

    def save_suffix_cache(self, path: str | Path | None = None) -> Path | None:
        """Deprecated since 0.5 (the file is a suffix index's, no cache's): ``save_suffix_file``."""
        warnings.warn("Pipeline.save_suffix_cache is deprecated: use save_suffix_file", DeprecationWarning, stacklevel=2)
        return self.save_suffix_file(path)

    def close(self) -> None:
        """Close the engines (their sessions and bound buffers); later requests fail. Closing twice is harmless."""
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

    def warm_up(self, k: int, prompt_tokens: int = 0, exact: bool = False) -> float:
        """Bring the shapes a request of at most ``k`` drafts calls at batch 1 into ``costs``: T = 1 .. k + 1 in the
        target, and in the draft its one- and two-token calls and a catch-up of ``CATCHUP_TOKENS`` (none with
        ``k`` = 0). A shape the table lacks is called twice and the quicker call measured: the first is cold, either may
        be stalled on a busy host, and the table takes its first measurement of a shape whole (one stalled call there
        can price drafting out of a short request); one it has (recalled from an earlier process) is left to the
        requests. With ``prompt_tokens``, each model first prefills that many tokens (a server's chunk), so that its
        first request's prefill is warm too. Returns the seconds taken.

        ONNX Runtime grows its buffers at the first call that needs them (on the real pair a cold 100-token prefill
        took 1.02 s in the target, 0.56 s the second time): the cost policy prices its first cycle with warm calls'
        costs. ``start`` runs it once per k and mode (``exact``: exact mode's target and costs)."""
        with self._warm_lock:
            began = time.perf_counter()
            target, costs = self._mode(exact)
            policy = CostPolicy(k, costs)  # what it measures, the cost policy learns as from a cycle
            shapes = [(target, t, None) for t in range(1, k + 2)]
            if k and self.draft is not None:
                shapes += [(self.draft, t, 1) for t in (1, 2, CATCHUP_TOKENS)]
            for engine in dict.fromkeys(engine for engine, _, _ in shapes):  # the target first
                room = engine.spec.capacity - slots_needed(0, 1, k)  # the longest prompt of a one-token request
                prompt = min(prompt_tokens, PREFILL_CHUNK, room)
                cache = engine.allocate_cache(1, engine.spec.capacity)
                if prompt > 0:
                    feed(engine, cache, np.zeros((1, prompt), np.int64), [prompt])
                for _, tokens, last in [shape for shape in shapes if shape[0] is engine]:
                    past = max(0, min(prompt, room - tokens))
                    known = costs.verify if last is None else costs.draft
                    if (1, tokens) in known or tokens > room:
                        continue
                    seconds = min(engine.infer(np.zeros((1, tokens), np.int64), np.array([past], np.int64), cache,
                                               last).seconds for _ in range(2))
                    policy.observe(CycleOutcome(1, verify_seconds=seconds, verify_tokens=tokens) if last is None else
                                   CycleOutcome(1, first_call_seconds=seconds, first_call_tokens=tokens) if tokens > 1 else
                                   CycleOutcome(1, later_call_seconds=seconds, later_calls=1))
            self._warmed.add((k, exact))
            return time.perf_counter() - began

    def encode(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Token ids of a prompt: text, or a flat sequence of integer ids inside the vocabulary. Returns [tokens] int64.

        Text must be valid Unicode (a lone surrogate is refused, naming where), and every id it encodes to must
        be inside the model's vocabulary: a tokenizer that maps a word beyond it is refused here, before any engine
        call, rather than failing the batch the prompt joins.
        """
        vocab = self.target.spec.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("prompt: got an empty string; expected at least one token")
            check_unicode(prompt, "prompt")
            ids = _tokenize(self.tokenizer, prompt, self.target.spec.capacity)
            if self._bos is not None and ids[:1] != [self._bos]:
                ids = [self._bos, *ids]
            ids = np.array(ids, np.int64)
            if ids.size and ids.max() >= vocab:
                outside = int(ids[ids >= vocab][0])
                raise ConfigError(f"prompt: encodes to token id {outside} ({self.tokenizer.id_to_token(outside)!r}), outside "
                                  f"the model's vocabulary [0, {vocab}): the artifact's tokenizer does not fit its models")
        elif isinstance(prompt, bytes) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise ConfigError(f"prompt: got {short(prompt)}; expected a string or a list of token ids")
        else:
            ids = checked_token_ids(prompt, vocab, "prompt ids")
        if ids.size == 0:
            raise ConfigError("prompt: encodes to no tokens; expected at least one")
        return ids

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, time_limit: float | None = None) -> list[int]:
        """Token ids of ``messages`` rendered with the tokenizer's chat template, as transformers'
        ``apply_chat_template(messages, tools=tools, tokenize=True)`` gives them (the template places BOS itself).
        ``time_limit``: CPU seconds the render may take (the template's own limit when None). The rendered text is
        bounded by what the capacity could ever hold (``CHARS_PER_TOKEN_BOUND`` a slot), before it is tokenized."""
        capacity = self.target.spec.capacity
        text = self.chat_template.render(messages, add_generation_prompt, tools, time_limit=time_limit,
                                         max_chars=CHARS_PER_TOKEN_BOUND * capacity)
        return _tokenize(self.tokenizer, text, capacity)

    def chat(self, messages: Sequence[dict], config: GenerationConfig | None = None) -> GenerationResult:
        """The assistant's reply to ``messages`` ([{"role": "system" | "user" | "assistant", "content": ...}])."""
        return self.generate([self.chat_prompt(messages)], config)[0]

    def start(self, prompts: Sequence[str | Sequence[int]], config: GenerationConfig,
              row_configs: Sequence[GenerationConfig] | None = None, capacity: int | None = None,
              suffix_index: SuffixIndex | None | Shared = SHARED, *, scope: str | None | Shared = SHARED,
              policy: Policy | None = None, request_ids: Sequence[str] | None = None, **listeners) -> Generation:
        """A batch in flight: call ``.step()`` until ``.done``. Validates everything before any work.

        ``config`` sets the batch's speculation (k, drafter, policy); ``row_configs`` gives each prompt its own
        settings (default: ``config``'s), its ``k`` capping that row's drafts. A seeded row's tokens do not depend on
        its batch: prompt i of one config draws from stream i of the seed, a prompt with its own config from stream 0.
        ``capacity`` fixes the cache slots per row (at least what the rows need), so that batches started
        apart can be merged. ``suffix_index``: the index of earlier requests' texts these draft from, and which
        theirs join when they finish (default: the index of ``scope`` in ``suffix_store``; None: their own text
        alone), or one per prompt. ``scope``: the name of the scope whose kept K/V (``prefix_cache``) they reuse and
        keep theirs in (default: the index's own scope, the pipeline's ``SHARED_SCOPE`` without one; None: no K/V of
        earlier requests), or one per prompt (a server's requests under different API keys). ``policy`` (default:
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
        target, costs = self._mode(config.exact)
        policy, drafter = speculation(config, self.draft, costs, policy)  # a drafter the artifact cannot have: refused
        ids = [self.check_request(prompt, row, capacity=capacity, k=config.max_drafts)
               for prompt, row in zip(prompts, row_configs)]
        limit = self._capacity_limit
        longest = max(row_configs, key=lambda c: c.max_new_tokens)
        specs = _model_specs(self.target, self.draft if drafter.uses_model else None)
        # the batch's slots a row (each row fits them alone: ``check_request``) and its caches' memory
        needed = plan_batch([len(i) for i in ids], replace(config, max_new_tokens=longest.max_new_tokens), limit, specs,
                            self.max_cache_bytes, capacity=capacity)
        request_ids = list(request_ids) if request_ids is not None else [f"req-{next(self._ids)}" for _ in ids]
        # one config for all: prompt i draws from stream i of its seed; a prompt with its own config is its own request
        scopes = row_scopes(self.suffix_store, suffix_index, scope, len(prompts))
        settings = [self._row_settings(row, 0 if mine else i, index, name)
                    for i, (row, (index, name)) in enumerate(zip(row_configs, scopes))]
        if config.speculative and (config.k, config.exact) not in self._warmed:
            self.warm_up(config.k, exact=config.exact)
        return Generation(target, drafter, policy, config, ids, request_ids, capacity=capacity or needed,
                          settings=settings, prefixes=self.prefix_cache, **listeners)

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
        """ConfigError for settings this artifact cannot decode with, before any work: not a GenerationConfig, stop
        ids outside the vocabulary, exact mode on a target that cannot give it (``exact.check_exact``), a drafter
        that needs the draft model it lacks, more drafts than a model's ring of recurrent states can roll back."""
        _check_config(config)
        self._check_stop_tokens(config)
        if config.exact:
            check_exact(self.target.spec)
        drafter = self.drafter_for(config)
        for spec in _model_specs(self.target, self.draft if drafter.uses_model else None).values():
            most = spec.max_drafts
            if config.max_drafts and most is not None and config.k > most:
                ring = min((s for s in spec.states if s.slots), key=lambda s: s.max_drafts)
                raise ConfigError(f"k: got {config.k}; the {spec.role} model keeps its recurrent state {ring.name!r} in a "
                                  f"ring of {ring.slots} positions, so a cycle verifies at most {most} drafts; use k <= "
                                  f"{most}")

    def check_mode(self, config: GenerationConfig) -> None:
        """Deprecated since 0.5: ``check_config``, which checks exact mode with the rest of a config."""
        warnings.warn("Pipeline.check_mode is deprecated: use check_config", DeprecationWarning, stacklevel=2)
        if config.exact:
            check_exact(self.target.spec)

    def policy_for(self, config: GenerationConfig) -> Policy:
        """A new request's policy; a cost policy prices by this pipeline's ``costs``, the engines' (acceptance
        belongs to the text: each request starts its own)."""
        return policy_of(config, self._mode(config.exact)[1])

    def _mode(self, exact: bool) -> tuple:
        """The target engine and the costs table of exact mode (``exact``) or of the default."""
        return (self._exact.target, self._exact.costs) if exact else (self.target, self.costs)

    def _row_settings(self, config: GenerationConfig, seed_stream: int = 0,
                     index: SuffixIndex | None = None, scope: str | None = None) -> RowSettings:
        """How one request decodes in any batch: ``config``'s settings, its stop strings on this tokenizer,
        its seed's stream (prompt i of one ``generate`` call draws from stream i), its scope's suffix index and the
        scope's name (whose kept K/V it reuses; None: none)."""
        return RowSettings(config, StopStrings(config.stop, self.decode).check if config.stop else None, seed_stream,
                           index, scope)

    def _check_stop_tokens(self, config: GenerationConfig) -> None:
        """ConfigError unless every one of ``config``'s stop token ids is inside the vocabulary."""
        vocab = self.target.spec.vocab_size
        outside = [t for t in config.stop_token_ids if t >= vocab]
        if outside:
            raise ConfigError(f"stop_token_ids: got {outside}; expected ids inside the vocabulary [0, {vocab})")

    def generate(self, prompts: str | Sequence[str | Sequence[int]], config: GenerationConfig | None = None,
                 batch_size: int | None = None, suffix_index: SuffixIndex | None | Shared = SHARED, *,
                 scope: str | None | Shared = SHARED) -> list[GenerationResult]:
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
        if self._remembered is not None:  # what this pipeline's calls cost, for the next process
            self._remembered.remember(self.costs, self._exact.costs)
        return results

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               suffix_index: SuffixIndex | None | Shared = SHARED, *,
               scope: str | None | Shared = SHARED) -> Iterator[StreamChunk]:
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
                    if self._remembered is not None:
                        self._remembered.remember(self.costs, self._exact.costs)
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
        """The text of ``token_ids`` (integers inside the vocabulary; ConfigError otherwise), special tokens skipped."""
        ids = checked_token_ids(token_ids, self.target.spec.vocab_size, "token_ids")
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def result(self, row: RowResult, config: GenerationConfig) -> GenerationResult:
        """A finished row as a result: its text (cut at a stop string under ``config``), tokens and stats."""
        stats = summarize(row.records, seconds=row.decode_seconds)
        stats["prefill_s"] = row.prefill_seconds
        stats["prompt_tokens"] = int(len(row.prompt_ids))
        stats["cached_prompt_tokens"] = row.cached_tokens
        stats["exact"] = config.exact
        text = StopStrings(config.stop, None).cut(self.decode(row.token_ids))
        return GenerationResult(text, row.token_ids, stats, row.finish_reason, row.records, row.error)

    def drafter_for(self, config: GenerationConfig) -> Drafter:
        """The drafter ``config`` names, on this artifact's draft model (the hybrid drafter without one drafts by
        the index alone; the model drafter without one is refused)."""
        return speculation(config, self.draft, self._mode(config.exact)[1])[1]


def _tokenize(tokenizer, text: str, capacity: int) -> list[int]:
    """Token ids of ``text``; a text longer than ``CHARS_PER_TOKEN_BOUND`` characters a slot of ``capacity`` is
    refused having tokenized no more than that much of it (a 12 MB prompt, or one enormous word, costs no more than
    its first part: tokenizing holds the interpreter, a server's event loop included)."""
    head = CHARS_PER_TOKEN_BOUND * capacity
    if len(text) > head:
        tokens = len(tokenizer.encode(text[:head], add_special_tokens=False).ids)
        if tokens >= capacity:
            raise ConfigError(f"prompt: {len(text):,} characters, and its first {head:,} alone are {tokens:,} "
                              f"tokens, over the artifact's capacity of {capacity} tokens")
        raise ConfigError(f"prompt: {len(text):,} characters; expected at most {head:,} ({CHARS_PER_TOKEN_BOUND} "
                          f"a token of the artifact's capacity of {capacity}: no text that fits is longer)")
    return tokenizer.encode(text, add_special_tokens=False).ids


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


def _check_config(config) -> None:
    if not isinstance(config, GenerationConfig):
        raise ConfigError(f"config: got {type(config).__name__}; expected a GenerationConfig")


def _check_prompt_list(prompts, expected: str) -> None:
    """A list (or tuple) of at least one prompt; a bare string or bytes is not one."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError(f"prompts: got {short(prompts)}; {expected}")


