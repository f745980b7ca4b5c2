"""The HTTP edge: the ASGI app, its routes, middlewares and error rendering, and the limits a connection
meets before a request reaches the gateway (header and body bounds, descriptors, API keys). Everything
that speaks HTTP is here, so the rooms below see only calls of ``gateway.service.Gateway`` and raise
only the domain errors of ``gateway.errors``.
"""
