"""Every declared setting of every registered family, fed random values: each is refused in one line naming the field,
or its export is an artifact the loader accepts whose greedy output is transformers' own for the same config.

The settings are the rules' own table (``exporter.checks.rules_of``), so a family or a field added to the table is
fuzzed with the rest. One random value a setting (a fixed seed): the refused ones cost a config check each; the
accepted ones of a family are exported together where they can be (one fused export, one transformers model), which
keeps the whole file to seconds.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import zlib

import pytest
import torch

from specdeploy.declared import Rope
from specdeploy.exporter import ARCHITECTURES, ExportError, ExportOptions, export_artifact
from specdeploy.exporter.checkpoint import load_tokenizer_and_config
from specdeploy.exporter.checks import rules_of
from specdeploy.exporter.registry import architecture_of
from tests import tiny
from tests.exporter.cases import PARITY_CASES

PROMPT = [1, 5, 9, 33, 17, 8]
NEW = 8
# model_type -> its base config: the parity case of that name, head_dim 16 (the fused form's least) where it is not
BASES = {model_type: PARITY_CASES[model_type] for model_type in PARITY_CASES if model_type in ARCHITECTURES}
BASES |= {"mistral": PARITY_CASES["mistral-window"], "gpt2": lambda: tiny.gpt2_config(n_embd=64)}


def test_every_registered_family_has_a_base_config():
    assert sorted(BASES) == sorted(ARCHITECTURES)


def candidates(value) -> list:
    """Values to try in place of ``value``: good ones near it and bad ones of every kind."""
    bad = [None, "abc", True, [1], {"x": 1}, float("nan"), float("inf")]
    if isinstance(value, bool):
        return [not value, "true", 1, None]
    if isinstance(value, int):
        return [value, value + 1, 2 * value, 0, -1, 2.5, 10**12, *bad]
    if isinstance(value, float):
        return [value, value * 2, value / 2, 0.0, -value, 1e30, *bad]
    if isinstance(value, str):
        return ["bogus", 3, *bad]
    if isinstance(value, list):
        return [value[:-1], value + value[:1], list(reversed(value)), ["x"] * len(value), "abc", 5, None]
    return [1, 4, 0, -3, 2.5, 0.5, "abc", True, [1, 2]]  # absent or null: what a file might set


def settings(model_type: str, config: dict) -> list[tuple[str, ...]]:
    """The paths (keys into config.json) of every setting the family's rules read, RoPE's keys inside its dict."""
    rules, part = rules_of(architecture_of(model_type))
    prefix = (part,) if part else ()
    own = config[part] if part else config
    paths = []
    for rule in rules:
        for field in rule.fields:
            if field in ("rope_parameters", "rope_scaling"):
                continue
            paths.append((*prefix, field))
        if isinstance(rule, Rope):
            rope = own.get("rope_parameters") or {}
            nested = [key for key, value in rope.items() if isinstance(value, dict)]
            for key in Rope.keys:
                paths.append((*prefix, "rope_parameters", *(nested[:1]), key))
    return paths


def edited(config: dict, path: tuple[str, ...], value) -> dict:
    config = copy.deepcopy(config)
    target = config
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return config


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """model_type -> (checkpoint dir, its config.json), each built once."""
    built = {}

    def get(model_type):
        if model_type not in built:
            model = tiny.build_model(BASES[model_type](), seed=3)
            directory = tiny.save_checkpoint(model, tmp_path_factory.mktemp(model_type) / "ckpt")
            built[model_type] = directory, json.loads((directory / "config.json").read_text())
        return built[model_type]

    return get


def _variant(source, config: dict, directory):
    """A checkpoint dir holding ``config`` beside ``source``'s weights and tokenizer (linked, not copied)."""
    directory.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "config.json":
            os.symlink(item, directory / item.name)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _refused(directory) -> str | None:
    """The one line the config check refuses ``directory`` with, or None where it takes it."""
    try:
        load_tokenizer_and_config(directory, tokenizer=False)
    except ExportError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("model_type", sorted(BASES))
def test_random_settings_are_refused_by_name_or_give_transformers_output(model_type, base, tmp_path):
    source, config = base(model_type)
    rng = random.Random(zlib.crc32(model_type.encode()))
    accepted, count = [], 0
    for path in settings(model_type, config):
        value = rng.choice(candidates(_get(config, path)))
        count += 1
        line = _refused(_variant(source, edited(config, path, value), tmp_path / f"case{count}"))
        if line is None:
            accepted.append((path, value))
            continue
        assert "\n" not in line, line
        assert path[-1] in line, f"{path} = {value!r} refused without naming it: {line}"
    assert accepted and len(accepted) < count  # the seed exercises both: refusals, and exports held to transformers
    groups = _groups(source, config, accepted, tmp_path)
    for number, group in enumerate(groups):
        _export_and_compare(source, config, group, tmp_path / f"group{number}")


def _get(config: dict, path: tuple[str, ...]):
    value = config
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _groups(source, config: dict, accepted: list, tmp_path) -> list[list]:
    """The accepted settings gathered into as few configs as the check takes together (each alone it took)."""
    groups: list[list] = []
    for number, change in enumerate(accepted):
        for group in groups:
            trial = config
            for path, value in [*group, change]:
                trial = edited(trial, path, value)
            if _refused(_variant(source, trial, tmp_path / f"trial{number}-{len(group)}-{id(group)}")) is None:
                group.append(change)
                break
        else:
            groups.append([change])
    return groups


def _export_and_compare(source, config: dict, group: list, directory) -> None:
    """Export ``group``'s config (fused; explicit where only that form takes it), and hold its greedy output to
    transformers'. A refusal at export names one of the group's settings, which is then left out."""
    from transformers import AutoModelForCausalLM

    from specdeploy import GenerationConfig, Pipeline

    for attempt in range(len(group) + 1):
        changed = config
        for path, value in group:
            changed = edited(changed, path, value)
        checkpoint = _variant(source, changed, directory / f"ckpt{attempt}")
        art = directory / f"art{attempt}"
        try:
            try:
                export_artifact(checkpoint, art, options=ExportOptions(graph="fused", isolate=False))
            except ExportError as exc:
                if "fused graph form" not in str(exc) and "partial rotary" not in str(exc):
                    raise
                export_artifact(checkpoint, art, options=ExportOptions(graph="explicit", isolate=False))
        except ExportError as exc:
            named = [change for change in group if change[0][-1] in str(exc)]
            assert named and "\n" not in str(exc), f"{group}: refused at export without naming a setting: {exc}"
            group = [change for change in group if change not in named]
            if not group:
                return
            continue
        break
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()  # transformers must take what we took
    ids, margins = list(PROMPT), []
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(torch.tensor([ids])).logits[0, -1]
            assert torch.isfinite(logits).all(), f"{group}: accepted, and transformers computes non-finite logits"
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]) / max(1.0, float(logits.abs().max())))
            ids.append(int(logits.argmax()))
    pipeline = Pipeline.load(art)
    try:
        ours = pipeline.generate([PROMPT], GenerationConfig(drafter="none", max_new_tokens=NEW, ignore_eos=True))
    finally:
        pipeline.close()
    ties = [i for i, margin in enumerate(margins) if margin < 1e-4]  # a proven near-tie ends the comparison there
    upto = ties[0] + 1 if ties else NEW
    assert ours[0].token_ids[:upto] == ids[len(PROMPT):len(PROMPT) + upto], f"{group}: greedy output differs"
    assert math.isfinite(sum(margins))
