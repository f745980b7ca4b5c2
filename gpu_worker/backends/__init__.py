"""Model backends behind the fixed contract ``batchstring(inputs) -> outputs``."""
