"""The HTTP gateway: accepts inference requests, puts them on the request bus, answers from the task store.

``settings.GatewaySettings`` configures it and ``service.Gateway`` does the work without HTTP, with the
rooms ``admission`` (whether a request is taken), ``answers`` (each caller's answer from the task
store), ``sharing`` (the result cache and collapsing) and ``keys`` (``Idempotency-Key``). ``edge`` is
the HTTP side: ``edge.routes`` are its routes by family, ``edge.app.create_app`` assembles the ASGI app.
The modules at this level (errors, settings, clock, publisher, ...) are shared by several rooms and
import none of them.
"""
