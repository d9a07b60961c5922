"""The public API: results, streaming, stop strings, and bad input that leaves the pipeline usable."""

from __future__ import annotations

import json
import shutil

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.contract import ContractError
from specdeploy.runtime.cache import CapacityError
from specdeploy.runtime.config import ConfigError
from specdeploy.runtime.policies import FixedK, Policy
from tests import tiny

GOOD = GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pipeline(pair_dir):
    return Pipeline.load(pair_dir)


def test_result_fields(pipeline):
    result = pipeline.generate("w5 w6 w7", GOOD)[0]
    assert len(result.token_ids) == 12 and result.finish_reason == "length"
    assert result.text == pipeline.decode(result.token_ids)
    stats = result.stats
    assert stats["tokens"] == 12 and stats["prompt_tokens"] == 3
    assert stats["mean_accepted_length"] == pytest.approx(sum(r.accepted + 1 for r in result.records) / len(result.records))
    assert stats["tokens_per_s"] > 0 and set(stats["time_split"]) == {"draft", "verify", "accept", "cache"}


def test_stream_yields_what_generate_returns(pipeline):
    chunks = list(pipeline.stream("w10 w11 w12", GOOD))
    whole = pipeline.generate("w10 w11 w12", GOOD)[0]
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert len(chunks) > 1 and chunks[-1].result is not None and chunks[-1].result.token_ids == whole.token_ids


def test_stop_string_cuts_text_and_tokens(pipeline):
    plain = pipeline.generate("w5 w6 w7", GOOD)[0]
    words = plain.text.split()
    stop = words[4]
    first = words.index(stop)
    result = pipeline.generate("w5 w6 w7", GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True, stop=(stop,)))[0]
    assert result.finish_reason == "stop"
    assert result.token_ids == plain.token_ids[: first + 1]
    assert stop not in result.text and result.text.split() == words[:first]


def test_token_id_prompts(pipeline):
    ids = pipeline.encode("w5 w6 w7").tolist()
    assert pipeline.generate([ids], GOOD)[0].token_ids == pipeline.generate("w5 w6 w7", GOOD)[0].token_ids


@pytest.mark.parametrize("prompt,config,error,match", [
    ("", GOOD, ConfigError, "empty"),
    ([], GOOD, ConfigError, "no tokens"),
    ([5, 500], GOOD, ConfigError, r"outside the vocabulary \[0, 128\)"),
    ([-1, 5], GOOD, ConfigError, "outside the vocabulary"),
    ("w5 " * 90, GOOD, CapacityError, "capacity 96"),
    ("w5", GenerationConfig(max_new_tokens=200), CapacityError, r"max_new_tokens \(200\)"),
    ("w5", GenerationConfig(k=120, max_new_tokens=4), CapacityError, r"k \(120\)"),
    ("w5", "not a config", ConfigError, "expected a GenerationConfig"),
])
def test_bad_input_is_refused_and_pipeline_stays_usable(pipeline, prompt, config, error, match):
    with pytest.raises(error, match=match):
        pipeline.generate([prompt], config)
    assert len(pipeline.generate("w5 w6", GOOD)[0].token_ids) == 12


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.5, "temperature: got -0.5"),
    ("top_p", 0.0, r"top_p: got 0.0; expected a number in \(0, 1\]"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -1, "top_k: got -1"),
    ("min_p", 1.0, "min_p"),
    ("max_new_tokens", 0, "max_new_tokens"),
    ("k", -2, "k: got -2"),
    ("policy", "greedy", "policy: got 'greedy'; expected one of cost, fixed, confidence, heuristic"),
    ("drafter", "eagle", "drafter"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("seed", 1.5, "seed"),
    ("stop", ("",), "stop"),
    ("stop_token_ids", (-3,), "stop_token_ids"),
    ("temperature", float("nan"), "temperature"),
])
def test_config_validation(field, value, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig(**{field: value})


def test_model_drafter_needs_a_draft(checkpoints, tmp_path):
    single = Pipeline.load(tiny.export_cli(tmp_path / "single", checkpoints["target"]))
    with pytest.raises(ConfigError, match="needs a draft model"):
        single.generate("w5", GenerationConfig(drafter="model"))
    assert single.generate("w5", GenerationConfig(drafter="prompt-lookup", max_new_tokens=4))[0].token_ids


def test_draft_from_another_tokenizer_is_refused(pair_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(pair_dir, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["models"]["draft"]["tokenizer_fingerprint"] = "0" * 64
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match="draft model was exported with another tokenizer"):
        Pipeline.load(broken)


def test_a_tokenizer_replaced_after_its_fingerprint_was_remembered_is_fingerprinted_again(pair_dir, tmp_path):
    """The fingerprint is remembered per file identity (0.35 s on Qwen's tokenizer): a new tokenizer file with a
    manifest re-hashed to match it is still compared with what the models were exported with."""
    from specdeploy.contract import sha256_file

    swapped = tmp_path / "swapped"
    shutil.copytree(pair_dir, swapped)
    Pipeline.load(swapped)  # remembers the fingerprint of the tokenizer file as it is
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, other ids
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    manifest = json.loads((swapped / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"] = sha256_file(swapped / "tokenizer.json")
    (swapped / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ContractError, match="target model was exported with another tokenizer"):
        Pipeline.load(swapped)


def test_tampered_file_is_refused_before_loading(pair_dir, tmp_path):
    broken = tmp_path / "tampered"
    shutil.copytree(pair_dir, broken)
    import onnx

    graph = onnx.load(str(broken / "draft.onnx"))
    graph.doc_string = "changed after export"  # still a valid graph, but not the exported one
    onnx.save(graph, str(broken / "draft.onnx"))
    with pytest.raises(ContractError, match="draft.onnx: sha256"):
        Pipeline.load(broken)
    Pipeline.load(broken, verify_hashes=False)  # an explicit opt-out loads it anyway


def test_first_divergence_reports_the_targets_own_margin(pipeline):
    import numpy as np

    config = GenerationConfig(drafter="none", max_new_tokens=10, ignore_eos=True)
    plain = pipeline.generate("w5 w6 w7", config)[0]
    assert pipeline.first_divergence("w5 w6 w7", plain.token_ids, plain.token_ids, config) is None
    other = list(plain.token_ids)
    other[6] = (other[6] + 1) % tiny.VOCAB
    found = pipeline.first_divergence("w5 w6 w7", plain.token_ids, other, config)
    # the target over the shared prefix in one call (fp32: the same logits as one token a call, to 1e-5)
    ids = np.array([[*pipeline.encode("w5 w6 w7"), *plain.token_ids[:6]]])
    engine = pipeline.target
    logits = engine.infer(ids, np.zeros(1, np.int64), engine.allocate_cache(1, ids.shape[1])).logits[0, -1]
    assert found["position"] == 6 and (found["reference_token"], found["other_token"]) == (plain.token_ids[6], other[6])
    assert found["margin"] == pytest.approx(float(logits[plain.token_ids[6]] - logits[other[6]]), abs=1e-5)
    assert found["margin"] > 0  # replayed as plain decoding ran it, the token plain decoding chose leads


class _Recording(Policy):
    """Drafts 3 by either source and hears every cycle."""

    def __init__(self):
        self.told, self.pasts, self.observed_pasts = [], [], []

    def next_k(self, batch, lookup=False) -> int:
        return 3

    def at_past(self, past: int) -> None:
        self.pasts.append(past)

    def observe(self, outcome) -> None:
        self.told.append((list(outcome.drafted), list(outcome.accepted), list(outcome.free)))
        self.observed_pasts.append(outcome.past)


def test_the_policy_hears_each_cycle_what_each_row_drafted_and_kept(pipeline):
    policy = _Recording()
    run = pipeline.start(["w5 w6 w7", "w9"], GOOD, suffix_index=None, scope=None, policy=policy, request_ids=["a", "b"])
    while not run.done:
        run.step()
    by_cycle = {}  # cycle -> records of the rows it served, in batch order
    for row in run.results:
        for record in row.records:
            by_cycle.setdefault(record.cycle, []).append(record)
    expected = [([r.drafted for r in records], [r.accepted for r in records], [r.free for r in records])
                for _, records in sorted(by_cycle.items())]
    assert len(expected) > 2 and policy.told == expected
    # each cycle is priced, and its calls learnt, at the past of its longest row: all but that row's last token
    lengths = {row.request_id: len(pipeline.encode(prompt)) for row, prompt in zip(run.results, ["w5 w6 w7", "w9"])}
    pasts = []
    for cycle in sorted(by_cycle):
        pasts.append(max(lengths[r.request_id] for r in by_cycle[cycle]) - 1)
        for r in by_cycle[cycle]:
            lengths[r.request_id] += r.committed
    assert policy.pasts == policy.observed_pasts == pasts and pasts[-1] > pasts[0]


def test_each_record_says_what_its_row_did_in_its_cycle(pipeline, self_dir):
    """Every field of a cycle record against what the cycle did (records are built by keyword, in one place), with a
    draft that is sometimes wrong and with the target drafting for itself (every draft kept)."""
    finals = set()
    for drafting in (pipeline, Pipeline.load(self_dir)):
        hybrid = GenerationConfig(k=3, max_new_tokens=14, ignore_eos=True, policy="fixed", drafter="hybrid")
        run = drafting.start(["w5 w6 w7 w5 w6", "w9"], hybrid, suffix_index=None, scope=None, policy=FixedK(3),
                             request_ids=["first", "second"])
        sizes = []
        while not run.done:
            sizes.append(run.state.batch)
            run.step()
        for row in run.results:
            assert sum(r.committed for r in row.records) == len(row.token_ids) == 14
            for r in row.records:
                assert r.request_id == row.request_id and r.batch_size == sizes[r.cycle]
                assert 0 <= r.accepted <= r.drafted <= 3 and 1 <= r.committed <= r.accepted + 1
                assert r.rejected_at == (r.accepted + 1 if r.accepted < r.drafted else None)
                assert r.final == ("plain" if r.drafted == 0 else "bonus" if r.accepted == r.drafted else "recovered")
                assert all(isinstance(s, float) and s >= 0 for s in (r.draft_s, r.verify_s, r.accept_s, r.cache_s))
                assert r.verify_s > 0 and isinstance(r.free, bool)
                finals.add(r.final)
            assert [r.cycle for r in row.records] == sorted({r.cycle for r in row.records})
        assert any(r.free for row in run.results for r in row.records)  # the repeated bigram is found in the index
    assert {"bonus", "recovered"} <= finals  # both the kept and the rejected branch were checked above


@pytest.mark.parametrize("call,match", [
    (lambda p: p.generate([b"w5 w6"], GOOD), r"prompt: got b'w5 w6'; expected a string or a list of token ids"),
    (lambda p: p.generate([[5.0, 6]], GOOD), r"prompt ids: got 5.0 among them; expected integers"),
    (lambda p: p.generate([[[5, 6]]], GOOD), r"prompt ids: got \[5, 6\] among them"),
    (lambda p: p.generate([[5, 2**70]], GOOD), r"range \[5, 1180591620717411303424\] outside the vocabulary"),
    (lambda p: p.generate([], GOOD), r"prompts: got \[\]; expected a prompt or a non-empty list"),
    (lambda p: p.generate(["w5"], GOOD, batch_size=-1), r"batch_size: got -1; expected an integer >= 1"),
    (lambda p: p.generate(["w5"], GOOD, batch_size=1.5), r"batch_size: got 1.5"),
    (lambda p: p.start("w5", GOOD), r"prompts: got 'w5'; expected a non-empty list"),
    (lambda p: p.generate(["w5"], GenerationConfig(stop_token_ids=(500,))), r"stop_token_ids: got \[500\]; expected ids"),
    (lambda p: Pipeline(p.manifest, p.tokenizer, p.target, max_cache_bytes=0), r"max_cache_bytes: got 0"),
    (lambda p: Pipeline(p.manifest, p.tokenizer, p.target, max_cache_bytes=float("nan")), r"max_cache_bytes: got nan"),
    (lambda p: Pipeline(p.manifest, p.tokenizer, p.target, max_cache_bytes="1e9"), r"max_cache_bytes: got '1e9'"),
])
def test_api_arguments_are_refused_naming_the_field(pipeline, call, match):
    with pytest.raises(ConfigError, match=match):
        call(pipeline)
    assert len(pipeline.generate("w5 w6", GOOD)[0].token_ids) == 12


@pytest.mark.parametrize("field,value,match", [
    ("confidence_threshold", "0.5", r"confidence_threshold: got '0.5'; expected a number in \(0, 1\)"),
    ("ignore_eos", "no", r"ignore_eos: got 'no'; expected True or False"),
    ("repetition_penalty", 1e-300, r"repetition_penalty: got 1e-300; expected a number in \[0.01, 100\]"),
    ("seed", -1, r"seed: got -1; expected an integer >= 0"),
    ("temperature", float("inf"), "temperature: got inf; expected a finite number"),
    ("max_new_tokens", True, "max_new_tokens: got True"),
    ("stop_token_ids", (2**64,), "stop_token_ids"),
    ("stop", 5, "stop: got 5"),
])
def test_config_never_coerces(field, value, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig(**{field: value})


def test_numpy_numbers_are_taken_as_the_numbers_they_hold(pipeline):
    import numpy as np

    config = GenerationConfig(max_new_tokens=np.int64(12), k=np.int32(3), temperature=np.float32(0), ignore_eos=np.bool_(True))
    assert config == GOOD and type(config.max_new_tokens) is int
    ids = pipeline.encode("w5 w6 w7")
    expected = pipeline.generate([ids.tolist()], GOOD)[0].token_ids
    assert pipeline.generate([ids], GOOD)[0].token_ids == expected
    assert pipeline.generate([[np.int32(t) for t in ids]], GOOD)[0].token_ids == expected


def test_a_partial_stop_string_is_never_streamed(pipeline):
    plain = pipeline.generate("w9", GOOD)[0]
    words = plain.text.split()
    stop = f"{words[3]} {words[4][:2]}"  # spans two tokens: the first alone may start it
    assert plain.text.count(stop) == 1
    config = GenerationConfig(k=3, max_new_tokens=12, ignore_eos=True, stop=(stop,))
    chunks = list(pipeline.stream("w9", config))
    final = chunks[-1].result.text
    assert chunks[-1].result.finish_reason == "stop" and final == plain.text[: plain.text.index(stop)]
    streamed = ""
    for chunk in chunks:
        streamed += chunk.text
        assert final.startswith(streamed), (streamed, final)  # nothing shown that is later taken back
    assert streamed == final and len(chunks) > 1


def test_a_huge_prompt_is_refused_from_its_first_part(pipeline):
    huge = "w5 " * 4_000_000  # 12 MB
    with pytest.raises(ConfigError, match=r"prompt: 12,000,000 characters, and its first 6,144 alone are .* tokens, "
                                          r"over the artifact's capacity of 96 tokens"):
        pipeline.generate(huge, GOOD)
    assert len(pipeline.generate("w5 " * 20, GOOD)[0].token_ids) == 12  # a long but fitting prompt still runs


def test_a_target_only_artifact_decodes_by_default_with_the_index_or_plainly(checkpoints, tmp_path):
    """The default speculation drafts by the suffix index alone where the artifact has no draft model, instead of failing;
    asking for the draft model there is refused, naming what to do."""
    single = Pipeline.load(tiny.export_cli(tmp_path / "single", checkpoints["target"]))
    prompt = "w5 w6 w7 w5 w6 w7 w5 w6"
    plain = single.generate([prompt], GenerationConfig(drafter="none", max_new_tokens=16, ignore_eos=True))[0]
    default = single.generate([prompt], GenerationConfig(max_new_tokens=16, ignore_eos=True))[0]
    assert default.token_ids == plain.token_ids and single.draft is None
    fixed = single.generate([prompt], GenerationConfig(policy="fixed", max_new_tokens=16, ignore_eos=True))[0]
    assert fixed.token_ids == plain.token_ids and any(r.free and r.drafted for r in fixed.records)
    with pytest.raises(ConfigError, match="needs a draft model"):
        single.generate([prompt], GenerationConfig(drafter="model"))


def test_closing_a_pipeline_closes_its_engines(pair_dir):
    import numpy as np

    from specdeploy.engines import EngineClosedError

    with Pipeline.load(pair_dir) as pipeline:
        assert pipeline.generate(["w5 w6"], GenerationConfig(max_new_tokens=2))[0].token_ids
    for engine in (pipeline.target, pipeline.draft):
        assert engine.session is None
        with pytest.raises(EngineClosedError, match="the engine is closed"):
            engine.infer(np.array([[5]]), np.zeros(1, np.int64), engine.allocate_cache(1, 4))


def test_check_config_refuses_what_the_artifact_cannot_decode_before_any_work(pair_dir, chat_target_dir, tmp_path):
    """One check of a config alone, as the serve CLI and the intake call it: exact mode on an explicit-form target
    without slot attention (an older export's), a drafter that needs the draft model an artifact lacks, a stop id
    outside the vocabulary."""
    import json
    import shutil

    older_dir = shutil.copytree(pair_dir, tmp_path / "older")
    manifest = json.loads((older_dir / "manifest.json").read_text())
    del manifest["models"]["target"]["slot_attention"]
    (older_dir / "manifest.json").write_text(json.dumps(manifest))
    pair, single, older = Pipeline.load(pair_dir), Pipeline.load(chat_target_dir), Pipeline.load(older_dir)
    pair.check_config(GenerationConfig())  # the default decodes anywhere
    single.check_config(GenerationConfig())
    pair.check_config(GenerationConfig(exact=True))  # an explicit export with slot attention gives exact mode
    with pytest.raises(ConfigError, match="exact: the target's graph is an older exporter's explicit form"):
        older.check_config(GenerationConfig(exact=True))
    with pytest.raises(ConfigError, match="needs a draft model"):
        single.check_config(GenerationConfig(drafter="model"))
    with pytest.raises(ConfigError, match=r"stop_token_ids: got \[100000\]; expected ids inside the vocabulary"):
        pair.check_config(GenerationConfig(stop_token_ids=[100000]))
    with pytest.raises(ConfigError, match="config: got dict; expected a GenerationConfig"):
        pair.check_config({"k": 3})


def test_admission_builds_nothing_and_a_batch_builds_its_policy_and_drafter_once(pipeline, monkeypatch):
    """check_config and check_request check a config and a request without building a policy or a drafter (they
    built both once per call: N + 1 times per start of N prompts); start builds one of each for its batch."""
    from specdeploy.runtime import registry

    built = []
    for table, name in ((registry.POLICIES, "fixed"), (registry.DRAFTERS, "hybrid")):
        make = table[name]
        monkeypatch.setitem(table, name, lambda *args, make=make, name=name: built.append(name) or make(*args))
    config = GenerationConfig(k=3, max_new_tokens=4, policy="fixed")
    pipeline.check_config(config)
    pipeline.check_request("w5 w6", config)
    assert built == []
    run = pipeline.start(["w5 w6", "w7", "w8 w9 w10"], config)
    assert built == ["fixed", "hybrid"] and run.batch == 3
