"""The syntax chat templates are written in: Jinja with transformers' settings and extensions, in one place for the
child that renders templates (``runtime/chat_worker.py``, which loads this file by its path) and for the checks that
compile a template before an artifact is accepted (``artifact_checks``). Standard library and jinja2 only."""

from __future__ import annotations

SETTINGS = {"trim_blocks": True, "lstrip_blocks": True}  # as transformers' apply_chat_template compiles templates


def extensions() -> list:
    """transformers' template extensions: ``{% generation %}`` (marks assistant text for training masks; renders its
    body) and loop controls (``{% break %}``, ``{% continue %}``)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return [Generation, loopcontrols]


def parse(text: str) -> None:
    """Parse ``text`` as a chat template: running none of it, so safe on any template. Raises jinja2's
    TemplateSyntaxError, or RecursionError for blocks nested past the parser's depth."""
    from jinja2 import Environment

    Environment(**SETTINGS, extensions=extensions()).parse(text)
