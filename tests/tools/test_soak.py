"""tools/soak.py: random requests until the cycles are run, every error kept with the configuration that raised it."""

from __future__ import annotations

from specdeploy import Pipeline
from tools import soak


def test_random_requests_run_the_cycles_asked_for_without_error(pair_dir):
    soaked = soak.soak(Pipeline.load(pair_dir, threads=1), cycles=300, warmup=100, seed=0)
    assert soaked.errors == []
    assert 300 <= soaked.cycles and soaked.requests > 10
    assert soaked.rss_start > 0 and soaked.rss_warm > 0 and soaked.rss_end > 0


class _Refusing:
    """A pipeline that refuses every prompt-lookup request and runs the others one cycle each."""

    def start(self, prompts, config):
        if config.drafter == "prompt-lookup":
            raise ValueError("refused")
        return _OneCycle()


class _OneCycle:
    done = False

    def step(self):
        self.done = True


def test_every_error_is_kept_with_its_configuration_and_the_soak_goes_on():
    soaked = soak.soak(_Refusing(), cycles=200, warmup=10, seed=1)
    assert soaked.cycles == 200 and soaked.errors
    assert all(e.startswith("ValueError: refused (GenerationConfig(") and "drafter='prompt-lookup'" in e
               for e in soaked.errors)
    # the seed decides the configurations: a refused one is counted as a cycle, the others ran
    assert soaked.requests > 0 and len(soaked.errors) < 200
