"""Which group-key types a DP query may release: those whose equal values print alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dp_core.errors import FeatureNotSupported
from dp_core.query import CANONICAL_KEY_TYPES, COLLATED_KEY_TYPES, AnalyzedQuery
from dp_core.sqlnodes import node_sql

TEXT_KEY_OIDS = frozenset({18, 19, 25, 1042, 1043})
"""Text key types ("char", name, text, bpchar, varchar): one group per spelling under a
deterministic collation."""
ONE_TEXT_KEY_OIDS = frozenset({16, 18, 19, 20, 21, 23, 25, 1042, 1043, 1082, 1083, 1114, 1184,
                               2950})
"""Group-key types whose text is one per value (bool, "char", name, integers, text, bpchar
(its text drops the trailing blanks that equality ignores), varchar, date, time,
timestamp(tz), uuid): rows matched by their key texts are the rows of one group. Not numeric
(1.0 = 1.00) nor floats (0 = -0), whose equal values can print differently."""
HASHED_KEY_OIDS = frozenset({700, 701, 1021, 1022, 1186, 1187, 1231, 1700, 3802, 3807, 3906,
                              3907, 4532, 6151})
"""Group-key types whose equal values can print differently and that have a hash function
(float4/8, interval ('1 day' = '24 hours'), numeric, jsonb, numrange, nummultirange and their
arrays): a group's row and its quantile trees are matched by the hash (`Key.hashed`)."""
RELEASED_KEY_OIDS = ONE_TEXT_KEY_OIDS | frozenset({
    26, 650, 774, 790, 829, 869, 1266, 3220,  # oid cidr macaddr8 money macaddr inet timetz
    # pg_lsn
    3904, 3908, 3910, 3912, 3926, 4451, 4533, 4534, 4535, 4536,  # ranges of exact types
    651, 775, 791, 1000, 1002, 1003, 1005, 1007, 1009, 1015, 1016, 1028, 1040, 1041,
    1115, 1182, 1183, 1185, 1270, 2951, 3221, 3905, 3909, 3911, 3913, 3927,  # arrays
})
"""Built-in key types a group released by partition selection may have as they are: equal
values are the same value, printed one way (a range of timestamps prints its bounds; arrays
differing in bounds are not equal). Not bpchar[]: 'a' = 'a  ' in it, printed with the blanks.
Not bytea, bit, varbit (nor their arrays): their text is 2 to 8 times their size, and a key's
text of one user's value of a few hundred MB would pass Postgres's 1 GB limit, an error.
Numeric and floats are grouped by one value of their equals, texts under "C"
(`canonical_key`); enums (user types) are allowed by their catalog entry."""
CANONICAL_KEY_OIDS = frozenset({700, 701, 1700})
"""float4, float8 and numeric: grouped by one value of their equals (`canonical_key`)."""
FIRST_USER_OID = 16384
_ENUM_SQL = ("SELECT t.typtype = 'e' OR (t.typcategory = 'A' AND e.typtype IS NOT DISTINCT "
             "FROM 'e') FROM pg_catalog.pg_type t LEFT JOIN pg_catalog.pg_type e "
             "ON e.oid = t.typelem WHERE t.oid = $1")


async def canonical_keys(query: AnalyzedQuery, types: Mapping[int, Any],
                         conn: Any) -> AnalyzedQuery:
    """The query with its numeric and float keys grouped by one value of their equals, and
    its texts under the "C" collation (`canonical_key`); 0A000 for a key of another type but
    those whose equal values print alike (`RELEASED_KEY_OIDS`, enums and their arrays): an
    interval ('1 day' = '24 hours'), a composite of numbers ('(1.0)' = '(1.00)'), citext or
    another extension's type would be released as one of its group's rows' spellings. A query
    of public groups releases its keys from their lists (checked as it is prepared)."""
    if not query.public_groups:
        for i, t in types.items():
            if t.oid in RELEASED_KEY_OIDS | CANONICAL_KEY_OIDS:
                continue
            if t.oid >= FIRST_USER_OID and await conn.fetchval(_ENUM_SQL, t.oid):
                continue
            raise FeatureNotSupported(
                f"not allowed in a DP query (GROUP BY a value of type {t.name}: equal values "
                "of it may print differently, and the group would show one of its rows' "
                f"spellings): {node_sql(query.keys[i].expr)}",
                hint="group by a column or expression of a type whose equal values print "
                     "alike (text, integers, dates, enums), such as a number made from it "
                     "(extract(epoch FROM ...), round(...))")
    return query.with_canonical_keys({i: t.name for i, t in types.items()
                                      if t.name in CANONICAL_KEY_TYPES | COLLATED_KEY_TYPES
                                      or t.name.endswith("[]")})
