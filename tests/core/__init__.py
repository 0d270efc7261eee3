"""Pure tests of dp_core (classifier, analysis and rewrite goldens, cost, mechanisms, quantiles,
accounting) and of the repository itself (architecture, docs, config)."""
