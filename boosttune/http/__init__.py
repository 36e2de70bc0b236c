"""The OpenAI-compatible HTTP server over an assembled engine (`boosttune serve`).

``server`` (the FastAPI app, its lifespan and handlers), ``protocol`` (the wire format and request
validation), ``worker`` (the one engine thread and its queue), ``metrics`` (Prometheus), ``text``
(streaming detokenization that never shows what a stop string will cut), ``connection`` (uvicorn's
HTTP/1.1 protocol with deadlines for slow or stalled clients) and ``timeouts`` (those deadlines).
"""
