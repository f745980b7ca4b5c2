"""The HTTP gateway: accepts inference requests, puts them on the request bus, answers from the task store.

``settings.GatewaySettings`` configures it, ``service.Gateway`` does the work without HTTP (with
``replies``, ``publisher``, ``replay`` and ``reads``), ``routes`` are its HTTP routes by family, and
``app.create_app`` assembles them into the ASGI app.
"""
