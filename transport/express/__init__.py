"""Express copies over Redis beside the Kafka records (``copies``), for requests and for batches."""

RECORD_DELAY_MS = 6.0
"""How long a Kafka record follows its express copy by default, where it is delayed at all: the
gateway's for a synchronous request, the batcher's for a batch to an idle worker (one flag, one
default, in both roles)."""
