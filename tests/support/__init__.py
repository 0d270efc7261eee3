"""What the tests share: the suite's Postgres and proxies, clients, helpers and fixtures.

- `paths`: where the repository, the golden pushdowns and the recorded BI questions are.
- `backend`: the test Postgres (`Backend`, `TEST_DATABASE`, preparing a database for the suite).
- `proxy`: in-process proxies (`LoopThread`, `Proxy`, `running_proxy`) and what tests ask
  them (`spent`, `show`, `reset_budget`).
- `fixtures`: the pytest fixtures every test can use (`backend`, `proxy`, `px`, ...), which
  tests/conftest.py registers.
- `engine`: the pure DP core's pipeline for one statement (`build`) and the golden cases.
- `clients`: psql against a proxy.
- `processes`: `dp-proxy` run as a process (its config file, waiting for a reload).
- `rawclient`: a protocol-level client; `dp_tester`: the paper's stochastic DP tester.
"""
