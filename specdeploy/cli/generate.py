"""``specdeploy generate``: stream completions and end with a stats table."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from .common import CliConsole, provider_options, speculation_options, suffix_file_option, threads_option


def read_prompts(path: Path) -> list[str]:
    """Prompt texts of a prompt file (see ``specdeploy.workloads.load_prompts``)."""
    from ..workloads import PromptFileError, load_prompts

    try:
        prompts = load_prompts(path)
    except PromptFileError as exc:
        raise click.ClickException(str(exc)) from exc
    chat = next((p for p in prompts if p.messages), None)
    if chat is not None:  # its text is only the last message: generating from it would drop the conversation
        raise click.ClickException(f"{path}: prompt {chat.id} is a chat prompt ('messages'); expected text prompts "
                                   "(--chat makes each a user message); `specdeploy bench --prompts` runs chat prompts")
    return [p.text for p in prompts]


@click.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompt-file", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="A .jsonl file with a 'prompt' field per line, or plain text with one prompt per line.")
@click.option("--max-new-tokens", "--max-tokens", "max_new_tokens", type=int, default=128, show_default=True,
              help="Tokens to generate at most.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0: off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1].")
@click.option("--min-p", type=float, default=0.0, show_default=True, help="Drop tokens below min_p x the top probability.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True, help="1 means off.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (same seed, same output).")
@speculation_options("Draft length (the maximum, for adaptive policies).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True,
              help="Token id that ends a request like EOS does (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (up to --max-new-tokens).")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True, help="Prompts decoded together.")
@provider_options(draft=True)
@threads_option
@click.option("--remember-costs/--no-remember-costs", default=True, show_default=True,
              help="Start the policy from the engine costs the last run measured on this artifact, provider and "
                   "thread count, and keep this run's (in $SPECDEPLOY_CACHE): a fresh process would learn them cold.")
@suffix_file_option("Draft from the texts of earlier runs kept in this file (the suffix index), and keep this run's "
                    "there (written atomically; through a symlink, to the file it names). A corrupt, foreign or "
                    "oversized file is refused in one line and left as it is: this run's texts are not saved.")
@click.option("--chat", is_flag=True,
              help="Each prompt is a user message, rendered with the tokenizer's chat template.")
@click.option("--system", default=None, help="With --chat: a system message before each prompt.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt: text, token_ids, stats.")
@click.option("--compare", is_flag=True,
              help="Also decode the prompts with the target alone, in the same process, and print the speedup "
                   "and whether the outputs are identical.")
def generate(directory, prompts, prompt_file, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
             seed, k, policy, drafter, confidence_threshold, exact, stop, stop_token_ids, ignore_eos, batch_size,
             provider, draft_provider, threads, remember_costs, suffix_file, chat, system, as_json, compare):
    """Generate text with speculative decoding from an exported artifact DIRECTORY."""
    from .. import GenerationConfig, Pipeline
    from ..contract import ContractError
    from ..engines import EngineInputError, ProviderError
    from ..runtime.cache import CapacityError
    from ..runtime.chat import ChatTemplateError
    from ..runtime.config import ConfigError

    prompts = list(prompts) + (read_prompts(prompt_file) if prompt_file else [])
    if not prompts:
        raise click.UsageError("give --prompt or --prompt-file")
    if system is not None and not chat:
        raise click.UsageError("--system goes with --chat")
    try:
        config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, k=k, policy=policy,
                                  drafter=drafter, stop=tuple(stop), stop_token_ids=stop_token_ids,
                                  confidence_threshold=confidence_threshold, ignore_eos=ignore_eos, exact=exact)
        pipeline = Pipeline.load(directory, provider=provider, draft_provider=draft_provider, threads=threads,
                                 remember_costs=remember_costs, suffix_file=suffix_file,
                                 log=lambda message: click.echo(f"warning: {message}", err=True))
        # what is generated from: the prompt texts, or their chat renderings as token ids
        opening = [] if system is None else [{"role": "system", "content": system}]
        inputs = [pipeline.chat_prompt([*opening, {"role": "user", "content": p}]) for p in prompts] if chat else prompts
        if compare:  # one short run of each first, so neither side pays the first-call set-up
            for warm in (config, dataclasses.replace(config, drafter="none")):
                pipeline.generate(inputs[:1], dataclasses.replace(warm, max_new_tokens=min(4, max_new_tokens)),
                                  suffix_index=None, scope=None)  # nothing of a warm-up for the measured run
        if as_json:
            results = pipeline.generate(inputs, config, batch_size=batch_size)
            for result in results:
                # finish_reason as OpenAI-style clients expect it (EOS and stop strings are both "stop");
                # stopped_by keeps which
                reason = "stop" if result.finish_reason in ("eos", "stop") else str(result.finish_reason)
                row = {"text": result.text, "token_ids": result.token_ids, "finish_reason": reason,
                       "stopped_by": str(result.finish_reason), "stats": result.stats}
                click.echo(strict_json(row | ({"error": result.error} if result.error else {})))
        else:
            results = _show(pipeline, [_heading(p, chat, system) for p in prompts], inputs, config, batch_size)
            _stats_table(results)
        failed = [(i, r.error) for i, r in enumerate(results) if r.finish_reason == "error"]
        if failed:
            detail = "; ".join(f"prompt {i}: {error}" for i, error in failed)
            raise click.ClickException(f"{len(failed)} of {len(results)} prompts failed: {detail}")
        if compare:
            plain_config = dataclasses.replace(config, drafter="none")
            plain = pipeline.generate(inputs, plain_config, batch_size=batch_size)
            divergences = [] if not config.greedy else [
                {"prompt": i, **d} for i, (prompt, a, b) in enumerate(zip(inputs, plain, results))
                if (d := pipeline.first_divergence(prompt, a.token_ids, b.token_ids, plain_config)) is not None]
            _comparison(results, plain, config, as_json, divergences)
        _save_suffix_file(pipeline)
    except (ConfigError, CapacityError, ContractError, ProviderError, EngineInputError, ChatTemplateError) as exc:
        raise click.ClickException(str(exc)) from exc


def _save_suffix_file(pipeline) -> None:
    try:
        pipeline.save_suffix_file()
    except OSError as exc:
        click.echo(f"warning: --suffix-file: not written ({exc})", err=True)


def strict_json(value) -> str:
    """JSON that strict parsers accept: undefined numbers (NaN, infinities) become null."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(value), allow_nan=False)


def _heading(prompt: str, chat: bool, system: str | None) -> str:
    """What is printed before a completion (rich markup): the text it continues, or with --chat the exchange by role,
    so that the answer never reads as glued to the user's message."""
    if not chat:
        return f"[bold cyan]{escape(prompt)}[/]"
    opening = "" if system is None else f"[bold]system:[/] {escape(system)}\n"
    return f"{opening}[bold cyan]user:[/] {escape(prompt)}\n[bold green]assistant:[/] "


def _show(pipeline, headings, inputs, config, batch_size):
    """Stream (or, in batches, print) each completion after its heading (``_heading``); generate from ``inputs``."""
    from ..runtime.pipeline import GenerationError, GenerationResult
    from ..runtime.telemetry import FinishReason, summarize

    out = CliConsole(highlight=False)
    if batch_size == 1:
        results = []
        for heading, source in zip(headings, inputs):
            try:
                stream = pipeline.stream(source, config)
                first = next(stream)  # the prompt is checked (and refused) before it is echoed
                out.print(heading, end="")
                for chunk in itertools.chain([first], stream):
                    out.print(chunk.text, end="", markup=False)
                results.append(chunk.result)
            except GenerationError as exc:  # this prompt failed; the others still run
                results.append(GenerationResult(text="", token_ids=[], stats=summarize([]), finish_reason=FinishReason.ERROR,
                                                error=str(exc)))
            out.print()
        return results
    results = pipeline.generate(inputs, config, batch_size=batch_size)
    for heading, result in zip(headings, results):
        out.print(heading, end="")
        out.print(result.text, markup=False)
    return results


def _comparison(spec, plain, config, as_json: bool, divergences: list[dict]) -> None:
    """Speculative against plain target decoding of the same prompts, measured in this process."""
    from ..runtime.telemetry import acceptance_by_position, mean_accepted_length

    def rate(results):
        tokens = sum(r.stats["tokens"] for r in results)
        return tokens / sum(r.stats["seconds"] for r in results)

    records = [rec for r in spec for rec in r.records]
    summary = {
        "speculative_tokens_per_s": rate(spec),
        "plain_tokens_per_s": rate(plain),
        "speedup": rate(spec) / rate(plain),
        "mean_accepted_length": mean_accepted_length(records),
        "acceptance_by_position": acceptance_by_position(records),
        "identical_outputs": sum(a.token_ids == b.token_ids for a, b in zip(spec, plain)),
        "prompts": len(spec),
        "divergences": divergences,  # greedy: where each differing output leaves plain decoding, and the margin
        "exact": config.exact,  # both sides ran in exact mode (--exact), or both in the default
    }
    if as_json:
        click.echo(strict_json({"comparison": summary}))
        return
    table = Table("", "tok/s", title=f"speculative ({config.drafter}, k={config.k}, {config.policy}) vs target alone")
    table.add_row("mode (both)", "exact (--exact)" if config.exact else "default")
    table.add_row("target alone", f"{summary['plain_tokens_per_s']:.2f}")
    table.add_row("speculative", f"{summary['speculative_tokens_per_s']:.2f}")
    table.add_row("speedup", f"{summary['speedup']:.2f}x")
    table.add_row("mean accepted length", f"{summary['mean_accepted_length']:.2f}")
    table.add_row("acceptance by position", " ".join(f"{a:.2f}" for a in summary["acceptance_by_position"]) or "-")
    same = f"{summary['identical_outputs']} / {summary['prompts']}"
    table.add_row("identical outputs", same + ("" if config.greedy else " (sampling: not expected)"))
    for d in divergences:
        table.add_row(f"prompt {d['prompt']} differs", f"from token {d['position']}: target margin {d['margin']:.2f}")
    CliConsole(stderr=True).print(table)
    if divergences and config.exact:
        CliConsole(stderr=True).print("In exact mode the outputs must be identical: please report this with the command.")
    elif divergences:
        CliConsole(stderr=True).print("A small margin is a near-tie the compressed target's arithmetic tipped (verifying "
                                   "K + 1 tokens at once is not bit-identical to decoding one; --exact makes it so): see "
                                   "docs/runtime.md, Exact mode.")


def _stats_table(results) -> None:
    table = Table("prompt", "tokens", "tok/s", "mean accepted", "acceptance", "by position", "finish",
                  title="speculative decoding")
    for i, r in enumerate(results):
        s = r.stats
        by_pos = " ".join(f"{a:.2f}" for a in s["acceptance_by_position"])
        table.add_row(str(i), str(s["tokens"]), f"{s['tokens_per_s']:.1f}", f"{s['mean_accepted_length']:.2f}",
                      f"{s['acceptance_rate']:.2f}", by_pos or "-", r.finish_reason)
    CliConsole(stderr=True).print(table)
