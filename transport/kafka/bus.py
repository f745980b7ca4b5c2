"""Transitional: the Kafka transports live in ``transport.kafka.producers`` and ``transport.kafka.consumers``.

Kept only until the composition root imports from those modules; nothing else imports this one.
"""

from transport.kafka.consumers import KafkaBatchConsumer, KafkaRequestConsumer
from transport.kafka.producers import KafkaBatchProducer, KafkaDeadLetterProducer, KafkaRequestProducer

__all__ = [
    "KafkaBatchConsumer",
    "KafkaBatchProducer",
    "KafkaDeadLetterProducer",
    "KafkaRequestConsumer",
    "KafkaRequestProducer",
]
