"""The OpenAI-compatible API (``/v1``): routes, request bodies, answers and error shape.

``routes`` (the endpoints), ``schemas`` (request bodies -> ``GenerationParams``), ``responses``
(response bodies), ``answers`` (the completion and chat wire formats of an answer), ``choices``
(their plans: one choice or ``n``), ``responses_request`` and ``responses_answer`` (the
Responses API's body and answer), ``errors`` (OpenAI's error shape under ``/v1``).
"""
