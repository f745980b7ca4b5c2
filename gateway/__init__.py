"""The HTTP gateway: accepts inference requests, puts them on the request bus, answers from the task store.

``settings.GatewaySettings`` configures it, ``service.Gateway`` does the work without HTTP, and
``app.create_app`` serves it over HTTP.
"""
