"""In-memory transports: the embedded mode's, and the unit tests'. One module per port, as in
``transport.redis`` and ``transport.kafka``.

They keep the same contracts as the Kafka and Redis ones (the contract tests run against both),
minus durability: a process that dies takes its in-memory work with it.
"""
