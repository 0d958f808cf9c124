"""The OpenAI-compatible API (``/v1``): routes, request bodies, answers and error shape.

``routes`` (the endpoints), ``schemas`` (request bodies -> ``GenerationParams``), ``responses``
(response bodies), ``answers`` (the completion and chat wire formats of an answer), ``errors``
(OpenAI's error shape under ``/v1``).
"""
