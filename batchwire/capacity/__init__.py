"""Capacity planning: a backend's latency curve (``profile``), a simulation of a deployment over it
(``simulate``), and the sizing that follows (``plan``)."""
