"""The Kafka transports. Importing the package guards aiokafka's connections against writes to a
connection the broker reset (``transport.kafka.connection``), before any client is made."""

from transport.kafka.connection import guard_writes

guard_writes()
