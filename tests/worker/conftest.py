"""A lone redis-server and a task store on it (``tests.support.lone_redis``), for the replica-wait tests."""

from tests.support.lone_redis import primary, store  # noqa: F401 (pytest finds fixtures by name)
