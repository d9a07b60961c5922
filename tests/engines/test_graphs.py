"""CUDA-graph bookkeeping, on the CPU, against a recording stand-in session (tests/engines/recording.py): one graph id
per call shape and cache, buffers that never move while their graph may replay, prefill chunks run plainly, and a
refused capture that falls back to plain runs and says so once. The tokens come from the real CPU session."""

from __future__ import annotations

import warnings

import pytest

from specdeploy import GenerationConfig, Pipeline
from specdeploy.engines import OrtEngine, ProviderError
from specdeploy.engines.graphs import PLAIN, open_session
from tests.engines.recording import record

PROMPTS = ["w5 w6 w7", "w9 w1 w3 w8 w2", " ".join(f"w{4 + i % 50}" for i in range(21))]  # the last: a 21-token prefill
GREEDY = GenerationConfig(max_new_tokens=10, k=3, policy="fixed", ignore_eos=True)
BUFFERS = ("input_ids", "seqlens_k", "num_logits", "logits", "ids")  # a shape's own, as opposed to the cache's


@pytest.fixture(scope="module")
def expected(fused_dirs):
    return [r.token_ids for r in Pipeline.load(fused_dirs["close"]).generate(PROMPTS, GREEDY)]


def _recorded(directory, **options):
    pipeline = Pipeline.load(directory)
    sessions = [record(pipeline.target, graphs=True, **options), record(pipeline.draft, graphs=True, **options)]
    return pipeline, sessions


def test_each_shape_and_cache_is_one_graph_whose_buffers_never_move(fused_dirs, expected):
    pipeline, sessions = _recorded(fused_dirs["close"])
    assert [r.token_ids for r in pipeline.generate(PROMPTS, GREEDY)] == expected
    for session in sessions:
        by_graph: dict[int, list] = {}
        for run in session.runs:
            batch, tokens = run.bound["input_ids"][2]
            if tokens > 16:  # a prefill chunk: its buffers are its own, never captured
                assert run.graph_id == PLAIN
                continue
            assert run.graph_id >= 1
            by_graph.setdefault(run.graph_id, []).append(run)
        assert len(by_graph) >= 3  # one-token draft steps, verifications of k + 1, catch-ups
        for graph_id, runs in by_graph.items():
            assert len({id(run.binding) for run in runs}) == 1, graph_id  # one binding per graph
            assert all(run.bound == runs[0].bound for run in runs), graph_id  # the same addresses at every replay
        ids = [runs[0].binding for runs in by_graph.values()]
        assert len(set(map(id, ids))) == len(by_graph)  # and one graph per binding
        shapes: dict[tuple, set] = {}  # bindings of one shape (rows run alone) share that shape's buffers
        for runs in by_graph.values():
            bound = runs[0].bound
            shape = bound["input_ids"][2] + bound["logits"][2][1:2]
            shapes.setdefault(shape, set()).add(tuple(bound[name][1] for name in BUFFERS))
        assert all(len(addresses) == 1 for addresses in shapes.values()), shapes
        assert max(by_graph) <= len(by_graph)  # ids handed out in turn, none wasted


def test_past_the_graph_limit_calls_run_plainly_and_say_so_once(fused_dirs, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline, sessions = _recorded(fused_dirs["close"], limit=2)
        assert [r.token_ids for r in pipeline.generate(PROMPTS, GREEDY)] == expected
    said = [w for w in caught if "2 CUDA graphs captured" in str(w.message)]
    assert len(said) == 2  # once per engine
    for session in sessions:
        graph_ids = {run.graph_id for run in session.runs}
        assert graph_ids == {PLAIN, 1, 2}


def test_a_capture_refused_while_running_falls_back_to_plain_runs_and_says_so_once(fused_dirs, expected):
    refusal = "CUDA failure 900: operation not permitted when stream is capturing"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline, sessions = _recorded(fused_dirs["close"], refuse_capture=refusal)
        assert [r.token_ids for r in pipeline.generate(PROMPTS, GREEDY)] == expected
    said = [w for w in caught if "could not capture a CUDA graph" in str(w.message)]
    assert len(said) == 2 and refusal in str(said[0].message)  # once per engine
    for session in sessions:
        refused = next(i for i, run in enumerate(session.runs) if run.graph_id not in (None, PLAIN))
        assert all(run.graph_id in (None, PLAIN) for run in session.runs[refused + 1 :])


def test_a_session_that_refuses_cuda_graphs_is_opened_without_them_once_said():
    """ONNX Runtime refuses, at session creation, to capture a graph with a node on the CPU EP: the session is made
    without CUDA graphs; an error of the session itself comes from that plain try."""
    refusal = ("[ONNXRuntimeError] : 1 : FAIL : This session cannot use the CUDA Graph feature as requested by the user "
               " as all compute graph nodes have not been partitioned to the CUDA EP.")
    asked = []

    def create(graphs: bool):
        asked.append(graphs)
        if graphs:
            raise RuntimeError(refusal)
        return "session"

    with pytest.warns(UserWarning, match="refuses CUDA graphs for this graph"):
        assert open_session(create, True, "target.onnx") == ("session", False)
    assert asked == [True, False]
    asked.clear()
    assert open_session(create, False, "target.onnx") == ("session", False) and asked == [False]

    def broken(graphs: bool):
        asked.append(graphs)
        raise RuntimeError(f"[ONNXRuntimeError] : 7 : INVALID_PROTOBUF ({graphs})")

    asked.clear()
    with pytest.raises(RuntimeError, match=r"INVALID_PROTOBUF \(False\)"):  # the session's own error, from the plain try
        open_session(broken, True, "target.onnx")
    assert asked == [True, False]


def test_cuda_graphs_are_refused_off_cuda(fused_dirs):
    from specdeploy.contract import Manifest

    spec = Manifest.read(fused_dirs["close"]).target
    with pytest.raises(ProviderError, match="cuda_graphs needs provider 'cuda', got 'cpu'"):
        OrtEngine(fused_dirs["close"] / spec.file, spec, cuda_graphs=True)
    assert OrtEngine(fused_dirs["close"] / spec.file, spec).graphs is None  # never on the CPU unless asked
