"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the one
request path: a wire schema (``schemas``), an answer format (``answers``), Anthropic's error
shape (``errors``) and the routes (``routes``)."""
