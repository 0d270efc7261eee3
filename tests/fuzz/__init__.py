"""Fuzzers (SQL, portals, settings, neighbours, malformed input) and the stochastic DP testers."""
