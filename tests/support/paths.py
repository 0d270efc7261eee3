"""Where the tests find the repository, the golden pushdowns and the recorded BI questions."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
"""The tests/ folder."""
ROOT = TESTS.parent
"""The repository: README.md, docs/, the packages, the Dockerfile."""
GOLDEN = TESTS / "golden" / "rewrite"
"""Input queries (`*.sql`) and their expected pushdowns (`*.expected.sql`)."""
FIXTURES = TESTS / "fixtures"
"""SQL that BI tools send, recorded (`*_questions.sql`, `metabase_privileges.sql`)."""
