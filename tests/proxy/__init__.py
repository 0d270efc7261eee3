"""DP queries through the proxy: answers, semantics, attacks, isolation, real clients, split pushdowns."""
