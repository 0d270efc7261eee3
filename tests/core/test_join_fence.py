"""The join rewrite of each scope that joins (dp_core.join_fence), read off the analysed query:
filters after the joins, outer-join chains from a protected table, sentinel rows, and what is
left as it was (the rows it keeps are checked on real data in tests/proxy/test_join_fence.py)."""

from __future__ import annotations

import pytest
from pglast.stream import RawStream

from dp_core.errors import FeatureNotSupported
from dp_core.query import KeyDomain
from dp_core.rewrite import pushdown
from tests.support.engine import build

_CAP = ("(SELECT * FROM (SELECT {a}.*, row_number() OVER (PARTITION BY {a}.uid ORDER BY "
        "hashtextextended(CAST({a}.ctid AS text), 0)) AS dp_rn FROM public.{t} AS {a}) AS dp_c "
        "WHERE dp_c.dp_rn <= 100) AS {a}")
P, V = _CAP.format(a="p", t="purchases"), _CAP.format(a="v", t="visits")


def fence(nulls: str, conds: str) -> str:
    return f"CASE WHEN pg_catalog.num_nulls({nulls}) >= 0 THEN {conds} END"


def rewritten(from_where: str) -> tuple[str, str]:
    query, _, _ = build(f"SELECT count(*) FROM {from_where}")
    return (", ".join(str(RawStream()(i)) for i in query.from_clause),
            str(RawStream()(query.where)))


def test_one_table_is_left_as_it_is() -> None:
    assert rewritten("visits v WHERE v.duration > 3") == (
        "public.visits AS v", "v.duration > 3 AND v.uid IS NOT NULL")


def test_two_tables_keep_their_inner_join_and_filter_after_it() -> None:
    assert rewritten("purchases p JOIN visits v ON v.uid = p.uid AND p.amount > 3 "
                     "WHERE v.uid = 42") == (
        f"{P} INNER JOIN {V} ON v.uid = p.uid",
        fence("p.uid, v.uid", "p.amount > 3 AND v.uid = 42 AND p.uid IS NOT NULL"))
    # a key written in WHERE stays a key, of the comma join or of the join it belongs to
    assert rewritten("visits v, countries c WHERE c.code = v.country AND c.name = 'x'") == (
        "public.visits AS v, countries AS c",
        "c.code = v.country AND " + fence("v.uid, c.*", "c.name = 'x' AND v.uid IS NOT NULL"))
    assert rewritten("visits v JOIN countries c ON true WHERE c.code = v.country")[0] == \
        "public.visits AS v INNER JOIN countries AS c ON c.code = v.country"
    # columns named without their item: Postgres says whose they are (a key, left in place)
    assert rewritten("visits JOIN countries ON code = country WHERE duration > 3") == (
        "public.visits INNER JOIN countries ON code = country",
        fence("visits.uid, countries.*", "duration > 3 AND visits.uid IS NOT NULL"))
    # two columns of one item are a filter of it
    assert rewritten("visits v JOIN countries c ON c.code = v.country AND v.browser = v.country"
                     )[1] == fence("v.uid, c.*", "v.browser = v.country AND v.uid IS NOT NULL")


def test_three_items_join_from_the_protected_table_outward() -> None:
    frm, where = rewritten("countries c JOIN visits v ON v.country = c.code "
                           "JOIN (VALUES (42)) t(u) ON t.u = v.uid WHERE c.name = 'x'")
    # (keys as COALESCE(x, x) on the side a join may null: equal, not strict)
    assert frm == ("countries AS c RIGHT JOIN public.visits AS v ON v.country = "
                   "COALESCE(c.code, c.code) LEFT JOIN ((VALUES (42)) OFFSET 0) AS t (u) "
                   "ON COALESCE(t.u, t.u) = v.uid")
    assert where == fence("c.*, v.uid, t.*", "c.code IS NOT NULL AND t.u IS NOT NULL AND "
                                              "c.name = 'x' AND v.uid IS NOT NULL")
    frm, where = rewritten("countries c, (VALUES (42)) t(u), purchases p "
                           "WHERE t.u = p.uid AND c.code = 'x'")
    # (a public item no key reads keeps its own conditions: read once, not once per row)
    assert frm == ("public.purchases AS p LEFT JOIN ((VALUES (42)) OFFSET 0) AS t (u) ON "
                   "COALESCE(t.u, t.u) = p.uid CROSS JOIN (SELECT * FROM countries AS c "
                   "WHERE c.code = 'x' OFFSET 0) AS c")
    assert where == fence("c.*, t.*, p.uid", "t.u IS NOT NULL AND p.uid IS NOT NULL")


def test_a_subquery_joins_as_the_nullable_side_or_gets_sentinel_rows() -> None:
    sub = "(SELECT uid, max(country) AS c FROM visits WHERE duration = 3 GROUP BY uid)"
    frm, where = rewritten(f"{sub} s JOIN purchases p USING (uid)")
    assert frm == (f"{sub.replace('visits', 'public.visits')} AS s RIGHT JOIN "
                   "public.purchases AS p USING (uid)")
    assert where == fence("s.uid, p.uid", "s.uid IS NOT NULL")
    # subqueries alone, or one an outer join keeps: a FULL JOIN, which reads both sides
    frm, where = rewritten(f"{sub} s JOIN (SELECT uid FROM purchases GROUP BY uid) q USING (uid)")
    assert " AS s FULL JOIN (SELECT uid FROM public.purchases GROUP BY uid) AS q USING (uid)" in frm
    assert where == fence("s.uid, q.uid", "s.uid IS NOT NULL AND q.uid IS NOT NULL")
    frm, where = rewritten(f"{sub} s LEFT JOIN countries c ON c.code = s.c AND c.name = 'x'")
    assert frm.endswith(" AS s FULL JOIN countries AS c ON COALESCE(c.code, c.code) = s.c "
                        "AND " + fence("s.uid, c.*", "c.name = 'x'"))
    assert where == fence("s.uid, c.*", "s.uid IS NOT NULL")
    # no key for a FULL JOIN: the subquery gets a row of NULLs where it has none
    frm, _ = rewritten(f"{sub} s LEFT JOIN countries c ON c.code > s.c")
    assert frm == ("(SELECT dp_s.* FROM ((VALUES (0))) AS dp_one (dp_x) LEFT JOIN "
                   f"{sub.replace('visits', 'public.visits')} AS dp_s ON TRUE OFFSET 0) "
                   "AS s LEFT JOIN countries AS c ON c.code > s.c")


def test_a_nullable_side_of_several_items_is_filtered_after_its_joins() -> None:
    frm, where = rewritten("purchases p LEFT JOIN (visits v JOIN countries c ON c.code = v.country "
                           "AND c.name = 'x') ON v.uid = p.uid AND v.duration = 4")
    assert frm == (f"{P} LEFT JOIN ({V} LEFT JOIN countries AS c ON COALESCE(c.code, c.code) "
                   "= v.country) ON COALESCE(v.uid, v.uid) = p.uid AND " + fence(
                       "v.uid, c.*", "v.duration = 4 AND c.name = 'x' AND c.code IS NOT NULL"))
    assert where == fence("p.uid, v.uid, c.*", "p.uid IS NOT NULL")


def test_public_subqueries_are_kept_apart_and_their_keys_on_the_nullable_side_one_item() -> None:
    """A public subquery is not merged (OFFSET 0: its constants would become conditions on
    the protected item joined to it); a nullable side's joins keep the item its outer join's
    keys touch, keys on its other items go after the joins."""
    frm, _ = rewritten("visits v JOIN (SELECT code FROM countries WHERE code = 'VU') c "
                       "ON c.code = v.country")
    assert frm.endswith("(SELECT code FROM countries WHERE code = 'VU' OFFSET 0) AS c "
                        "ON c.code = v.country")
    frm, _ = rewritten("purchases p LEFT JOIN (visits v JOIN (VALUES (7)) t(u) ON t.u = v.uid) "
                       "ON v.uid = p.uid AND t.u = p.uid")
    assert frm == (f"{P} LEFT JOIN ({V} LEFT JOIN ((VALUES (7)) OFFSET 0) AS t (u) ON "
                   "COALESCE(t.u, t.u) = v.uid) ON COALESCE(v.uid, v.uid) = p.uid AND "
                   + fence("v.uid, t.*", "t.u = p.uid AND t.u IS NOT NULL"))


def test_in_and_exists_are_evaluated_first_on_every_row() -> None:
    _, where = rewritten("visits v WHERE v.duration = 3 AND v.country IN (SELECT code FROM countries)")
    assert where == fence("v.uid", "v.country IN (SELECT code FROM countries) AND "
                                   "v.duration = 3 AND v.uid IS NOT NULL")
    # an EXISTS that reads no row of the query: a one-time filter, run before anything
    _, where = rewritten("visits v WHERE v.duration = 3 AND EXISTS (SELECT 1 FROM countries)")
    assert where == "EXISTS (SELECT 1 FROM countries) AND " + fence(
        "v.uid", "v.duration = 3 AND v.uid IS NOT NULL")


@pytest.mark.parametrize("from_where", [
    "visits v FULL JOIN (purchases p JOIN countries c ON c.code = p.category) ON v.uid = p.uid",
    "visits v JOIN countries c ON c.code = v.country JOIN (purchases p JOIN countries d "
    "ON d.code = p.category) USING (category)",
])
def test_joins_it_cannot_rewrite_are_refused(from_where: str) -> None:
    with pytest.raises(FeatureNotSupported):
        build(f"SELECT count(*) FROM {from_where}")


def test_public_groups_keep_their_domain_after_the_joins() -> None:
    query, plan, _ = build("SELECT v.browser, count(*) FROM visits v JOIN purchases p USING (uid) "
                           "GROUP BY v.browser")
    key = query.keys[0]
    query = query.__class__(**{**query.__dict__, "keys": (
        key.__class__(**{**key.__dict__, "domain": KeyDomain(("a", "b"))}),)})
    main = pushdown(query, plan, order_seed=1).main
    assert main is not None
    assert ("CASE WHEN pg_catalog.num_nulls(v.uid, p.uid) >= 0 THEN CAST(v.browser AS text) "
            "= ANY(CAST(ARRAY['a', 'b'] AS text[])) END") in main
