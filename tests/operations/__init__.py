"""Running it: embedded Postgres, workers, lifecycle, logs, metrics, CLI and Docker files, ledger
processes, backend login, demo data, faults."""
