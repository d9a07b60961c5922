"""``specdeploy serve``: an OpenAI-compatible server with continuous batching (the ``serve`` extra)."""
