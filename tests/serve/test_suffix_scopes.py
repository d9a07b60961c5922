"""The server's scopes: a request drafts from earlier answers under its own API key alone (by default), read from its
records; everyone's with --suffix-scope global; none with none; and reuses the K/V of its key's texts (everyone's
under global, its key's still under none). /metrics reports the index's size."""

from __future__ import annotations

import gc
import weakref

import openai
import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.suffix_store import SuffixStore
from specdeploy.serve.scopes import key_scope

from .conftest import metrics, serving

SUFFIX = GenerationConfig(k=4, policy="fixed", drafter="suffix")
PROMPT = "w60 w61 w62 w63"


@pytest.fixture()
def fresh(pair_dir):
    return Pipeline.load(pair_dir)  # an empty index for each test


def _ask(url: str, key: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=20, extra_body={"ignore_eos": True})


def _sources(rows) -> list[set]:  # the requests whose texts each row's drafts followed
    return [{r.drafted_from for r in row.records if r.drafted_from is not None} for row in rows]


@pytest.mark.parametrize("scope", ["key", "global", "none"])
def test_a_request_drafts_from_earlier_answers_only_within_its_scope(fresh, scope):
    """alice asks, then alice and bob ask the same: under ``key`` only alice's second request drafts from her first
    answer (bob's never from hers), under ``global`` both do, under ``none`` neither."""
    finished, keys = [], []
    with serving(fresh, config=SUFFIX, suffix_scope=scope) as (url, scheduler):
        scheduler.on_finish = lambda ticket, row, inner=scheduler.on_finish: (finished.append(row), inner(ticket, row))
        for key in ("alice", "alice", "bob"):
            _ask(url, key)
            keys.append(key)
        seen = metrics(url)
    ids = [row.request_id for row in finished]
    for i, (row, key) in enumerate(zip(finished, keys)):
        earlier = set(ids[:i])
        mine = {ids[j] for j in range(i) if keys[j] == key}
        sources = _sources([row])[0] - {row.request_id}  # drafts from its own text are always allowed
        shares = {"key": bool(mine), "global": bool(earlier), "none": False}[scope]
        assert bool(sources) == shares, (scope, key, sources)
        assert sources <= (mine if scope == "key" else earlier)  # never another key's answer under "key"
    assert finished[1].token_ids == finished[2].token_ids == finished[0].token_ids  # the target's text, always
    kept = seen["specdeploy_suffix_index_tokens"]
    assert (kept == 0) == (scope == "none") and seen["specdeploy_suffix_index_bytes"] >= kept
    assert seen["specdeploy_suffix_index_scopes"] == {"key": 2, "global": 1, "none": 0}[scope]


@pytest.mark.parametrize("scope", ["key", "global", "none"])
def test_a_prompt_reuses_earlier_k_v_only_within_its_scope(fresh, scope):
    """The prefix cache follows the request's scope: alice's second request reuses her first prompt's K/V (its usage
    says how many tokens), bob's only under ``global``; ``none`` keeps drafting to a request's own text, not its K/V
    to itself (a ticket carries its scope, not its index's); /metrics counts them as vLLM does."""
    cached = []
    with serving(fresh, config=SUFFIX, suffix_scope=scope) as (url, _):
        for key in ("alice", "alice", "bob"):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            answer = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=20,
                                               extra_body={"ignore_eos": True})
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        seen = metrics(url)
    prompt = len(fresh.encode(PROMPT))
    assert cached == {"key": [0, prompt - 1, 0], "global": [0, prompt - 1, prompt - 1], "none": [0, prompt - 1, 0]}[scope]
    labels = '{engine="0",model_name="tiny"}'
    assert seen[f"vllm:prefix_cache_hits_total{labels}"] == sum(cached)
    assert seen[f"vllm:prefix_cache_queries_total{labels}"] == 3 * prompt
    assert seen["specdeploy_prefix_cache_texts"] == {"key": 2, "global": 1, "none": 2}[scope]


def test_forty_clients_through_a_store_of_four_leave_nothing_of_the_evicted_alive_and_metrics_agree(pair_dir):
    """Without --api-key every bearer token is a scope: 40 of them through a store of 4 scopes leave at most 4 suffix
    indexes alive and K/V kept for those alone, and /metrics counts all that is alive (an evicted index used to stay
    referenced by its scope's kept K/V, outside every bound and every metric)."""
    pipeline = Pipeline.load(pair_dir, suffix_store=SuffixStore(max_scopes=4))
    refs = []
    with serving(pipeline, config=SUFFIX) as (url, _):
        for i in range(40):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=f"client-{i}", max_retries=0)
            client.completions.create(model="tiny", prompt=f"w{i} w{i + 1} w{i + 2}", temperature=0, max_tokens=6)
            name = key_scope(f"Bearer client-{i}")
            refs.append((name, weakref.ref(pipeline.suffix_store.index(name))))
        gc.collect()
        seen = metrics(url)
        alive = {name: ref() for name, ref in refs if ref() is not None}
        assert len(alive) <= 4
        assert pipeline.prefix_cache.scopes() <= set(alive)
        assert seen["specdeploy_suffix_index_scopes"] == len(alive)
        assert seen["specdeploy_suffix_index_bytes"] == sum(index.nbytes() for index in alive.values()) > 0
        assert seen["specdeploy_prefix_cache_texts"] == len(pipeline.prefix_cache) <= 4
