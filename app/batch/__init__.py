"""``python -m app batch``: an OpenAI Batch API input file through the server's request path.

    reader (a thread) ─► requests (the line's envelope) ─► endpoints (the /v1 schema, the request
    builder, AsyncEngine.submit, the answer format) ─► results (in input order) ─► the output file

``config`` (the command's flags: the serve flags that make sense offline, and the batch's own),
``reader`` (lines off the input, bounded read-ahead), ``requests`` (one line's envelope checked),
``endpoints`` (what ``/v1/completions`` and ``/v1/chat/completions`` would answer), ``results``
(OpenAI's batch output lines and the reorder buffer), ``progress`` (the bar and the summary),
``runner`` (the engine's lifetime and the two loops: feed lines in, write results out).
"""
