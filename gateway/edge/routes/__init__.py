"""The gateway's HTTP routes, one module per family; each adds its routes to the app's router.

The endpoints find the :class:`~gateway.service.Gateway` and the composition root's parts in
``app.state`` (:func:`gateway.edge.routes.deployment.deployment_of`); the settings only shape what the
OpenAPI document says of them. An endpoint documented without ``description=`` has no docstring:
FastAPI would publish it as one.
"""
