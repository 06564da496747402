"""Edge0: serve Mixture-of-Experts models whose weights do not fit in memory."""

__version__ = "0.1.0"
