"""tools/trace_cycle.py lists the modules and functions a cycle, or a config on its way to the engine, runs through."""

from __future__ import annotations

from specdeploy import GenerationConfig, Pipeline
from specdeploy.runtime.cost_policy import CostPolicy
from tools import trace_cycle


def test_a_default_cycle_runs_the_policy_the_drafters_the_target_acceptance_and_the_commit(pair_dir):
    """The CLI's, the server's and GenerationConfig's default: the cost policy over the hybrid drafter. A cycle after a
    drafting one reads the policy, the drafters, the target, acceptance and the commit."""
    run = Pipeline.load(pair_dir).start(["w5 w6 w7 w8"], GenerationConfig(max_new_tokens=80, ignore_eos=True))
    assert isinstance(run.policy, CostPolicy) and run.drafter.uses_model and run.drafter.finds_free
    run.prefill()
    for _ in range(3):  # the draft's cache checked once, at its first call; the costs warm
        run.step()
    # a steady cycle: one that binds no new call shape (a shape's first call binds its buffers once; the hybrid's
    # draft meets a new one when it catches up after index cycles, as the policy's timings decide)
    traced = [trace_cycle.trace_step(run) for _ in range(4)]
    steady = [v for v in traced if "ShapeBuffers._bind" not in v.get("specdeploy.engines.ort", [])]
    assert steady, "every traced cycle bound a new call shape"
    visited = steady[0]
    assert "propose" in visited["specdeploy.runtime.suffix"]
    assert "CostPolicy.next_k" in visited["specdeploy.runtime.cost_policy"]
    assert "CostPolicy.observe" in visited["specdeploy.runtime.cost_policy"]
    assert "HybridDrafter.propose" in visited["specdeploy.runtime.drafters"]
    assert "greedy_accept_row" in visited["specdeploy.runtime.acceptance"]
    assert {"Generation.cycle_rows", "BatchState.commit"} <= set(visited["specdeploy.runtime.decoder"])
    assert "Engine.infer" in visited["specdeploy.engines.base"]


def test_a_config_walks_from_the_pipeline_to_the_first_engine_call(pair_dir):
    """Following a GenerationConfig (with a stop string) from Pipeline.generate to its first engine call passes the
    registry, the stop strings and the decoder (tools/trace_cycle.py --config-walk)."""
    pipeline = Pipeline.load(pair_dir)
    config = GenerationConfig(max_new_tokens=4, stop=["w9"])
    pipeline.generate(["w5"], config)  # warmed up: the first engine call is the batch's own
    walk = trace_cycle.trace_config(pipeline, ["w5 w6 w7"], config)
    modules = [module for module, _ in walk]
    assert modules[0] == "specdeploy.runtime.pipeline" and modules[-1].startswith("specdeploy.engines.")
    assert {"specdeploy.runtime.registry", "specdeploy.runtime.stops", "specdeploy.runtime.decoder"} <= set(modules)
