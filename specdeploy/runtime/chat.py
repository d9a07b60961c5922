"""Chat templates: messages rendered to a prompt as transformers' ``apply_chat_template`` renders them.

A template comes from the artifact's tokenizer_config.json (kept, and hashed, by the exporter) and
is untrusted code: it runs in Jinja's immutable sandbox, with the globals and filters transformers
gives it (``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML), so the same
template renders the same string here as there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from .config import ConfigError

MAX_MESSAGES = 1024


class ChatTemplate:
    """A tokenizer's chat template with its BOS/EOS tokens and whether plain prompts start with BOS."""

    def __init__(self, config: dict):
        self.template = config.get("chat_template")
        self.bos_token, self.eos_token = config.get("bos_token"), config.get("eos_token")
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self._compiled = None

    @classmethod
    def read(cls, path: Path) -> ChatTemplate:
        return cls(json.loads(Path(path).read_text(encoding="utf-8")))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text of ``messages`` ([{"role": ..., "content": ...}, ...]), ending with the assistant's
        turn opened when ``add_generation_prompt``; ``tools`` (JSON schemas, as transformers takes them) go to the
        template as its ``tools`` variable."""
        from jinja2.exceptions import SecurityError, TemplateError

        if self.template is None:
            raise ConfigError("messages: this artifact's tokenizer has no chat template; give a plain prompt instead")
        messages = _checked(messages)
        try:
            return self._template().render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                           documents=None, bos_token=self.bos_token, eos_token=self.eos_token)
        except SecurityError as exc:
            raise ConfigError(f"chat template: refused by the sandbox ({exc})") from exc
        except TemplateError as exc:  # the template's own raise_exception, or a broken template
            raise ConfigError(f"chat template: {exc}") from exc

    def _template(self):
        if self._compiled is None:
            self._compiled = _environment().from_string(self.template)
        return self._compiled


def _checked(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ConfigError(f"messages: got {type(messages).__name__}; expected a non-empty list of messages")
    if len(messages) > MAX_MESSAGES:
        raise ConfigError(f"messages: got {len(messages)}; expected at most {MAX_MESSAGES}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ConfigError(f"messages[{i}]: got {str(message)[:60]!r}; expected {{'role': str, 'content': str}}")
    return [dict(message) for message in messages]


def _environment():
    """A sandboxed Jinja environment with transformers' settings, filters and globals."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment
