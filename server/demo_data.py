"""The seeded demo dataset of DESIGN §1, generated inside Postgres in a few seconds.

Every random draw is a hash of (row key, salt), so the data is the same on
every run and every plan. Shape: `visits` ≈ 200k rows over 20k users with
Pareto-distributed rows per user (median 3, a few users in the thousands),
browser Zipf over 20 names, country per user Zipf(2) over 150 codes (rare ones
have a handful of users, so thresholding visibly drops them), duration
exponential per user capped at 3600 with 3% NULLs; `purchases` for 30% of the
users; `countries` unprotected.
"""

from __future__ import annotations

DEMO_USERS = 20_000
VISITS_PARETO_ALPHA = 1.15
VISITS_PER_USER_MIN = 2
VISITS_PER_USER_CAP = 5000

BROWSERS = [
    "Chrome", "Safari", "Edge", "Firefox", "Samsung Internet", "Opera", "UC Browser",
    "Brave", "Vivaldi", "Yandex", "QQ Browser", "Whale", "DuckDuckGo", "Silk",
    "Pale Moon", "Waterfox", "SeaMonkey", "Konqueror", "Lynx", "Midori",
]

CATEGORIES = [
    "books", "electronics", "groceries", "clothing", "home", "toys", "sports",
    "beauty", "garden", "music", "software", "travel",
]

# (code, name, region), most common first: the Zipf rank of each country.
COUNTRIES = [
    ("US", "United States", "Americas"), ("IN", "India", "Asia"), ("BR", "Brazil", "Americas"),
    ("DE", "Germany", "Europe"), ("GB", "United Kingdom", "Europe"), ("FR", "France", "Europe"),
    ("JP", "Japan", "Asia"), ("ID", "Indonesia", "Asia"), ("MX", "Mexico", "Americas"),
    ("CA", "Canada", "Americas"), ("IT", "Italy", "Europe"), ("ES", "Spain", "Europe"),
    ("KR", "South Korea", "Asia"), ("TR", "Turkey", "Asia"), ("NG", "Nigeria", "Africa"),
    ("PH", "Philippines", "Asia"), ("VN", "Vietnam", "Asia"), ("PL", "Poland", "Europe"),
    ("AU", "Australia", "Oceania"), ("AR", "Argentina", "Americas"), ("EG", "Egypt", "Africa"),
    ("PK", "Pakistan", "Asia"), ("NL", "Netherlands", "Europe"), ("TH", "Thailand", "Asia"),
    ("CO", "Colombia", "Americas"), ("ZA", "South Africa", "Africa"), ("BD", "Bangladesh", "Asia"),
    ("UA", "Ukraine", "Europe"), ("SE", "Sweden", "Europe"), ("MY", "Malaysia", "Asia"),
    ("CL", "Chile", "Americas"), ("PE", "Peru", "Americas"), ("BE", "Belgium", "Europe"),
    ("SA", "Saudi Arabia", "Asia"), ("KE", "Kenya", "Africa"), ("RO", "Romania", "Europe"),
    ("CH", "Switzerland", "Europe"), ("AT", "Austria", "Europe"), ("PT", "Portugal", "Europe"),
    ("CZ", "Czechia", "Europe"), ("GR", "Greece", "Europe"), ("IL", "Israel", "Asia"),
    ("DK", "Denmark", "Europe"), ("FI", "Finland", "Europe"), ("NO", "Norway", "Europe"),
    ("IE", "Ireland", "Europe"), ("NZ", "New Zealand", "Oceania"), ("SG", "Singapore", "Asia"),
    ("HU", "Hungary", "Europe"), ("AE", "United Arab Emirates", "Asia"),
    ("MA", "Morocco", "Africa"), ("DZ", "Algeria", "Africa"), ("VE", "Venezuela", "Americas"),
    ("EC", "Ecuador", "Americas"), ("GH", "Ghana", "Africa"), ("ET", "Ethiopia", "Africa"),
    ("LK", "Sri Lanka", "Asia"), ("KZ", "Kazakhstan", "Asia"), ("RS", "Serbia", "Europe"),
    ("BG", "Bulgaria", "Europe"), ("SK", "Slovakia", "Europe"), ("HR", "Croatia", "Europe"),
    ("TN", "Tunisia", "Africa"), ("GT", "Guatemala", "Americas"), ("DO", "Dominican Republic", "Americas"),
    ("BO", "Bolivia", "Americas"), ("UY", "Uruguay", "Americas"), ("CR", "Costa Rica", "Americas"),
    ("PA", "Panama", "Americas"), ("NP", "Nepal", "Asia"), ("MM", "Myanmar", "Asia"),
    ("KH", "Cambodia", "Asia"), ("UZ", "Uzbekistan", "Asia"), ("JO", "Jordan", "Asia"),
    ("LB", "Lebanon", "Asia"), ("QA", "Qatar", "Asia"), ("KW", "Kuwait", "Asia"),
    ("OM", "Oman", "Asia"), ("BH", "Bahrain", "Asia"), ("TZ", "Tanzania", "Africa"),
    ("UG", "Uganda", "Africa"), ("CM", "Cameroon", "Africa"), ("CI", "Côte d'Ivoire", "Africa"),
    ("SN", "Senegal", "Africa"), ("ZM", "Zambia", "Africa"), ("ZW", "Zimbabwe", "Africa"),
    ("AO", "Angola", "Africa"), ("MZ", "Mozambique", "Africa"), ("RW", "Rwanda", "Africa"),
    ("SI", "Slovenia", "Europe"), ("LT", "Lithuania", "Europe"), ("LV", "Latvia", "Europe"),
    ("EE", "Estonia", "Europe"), ("BA", "Bosnia and Herzegovina", "Europe"),
    ("MK", "North Macedonia", "Europe"), ("AL", "Albania", "Europe"), ("MD", "Moldova", "Europe"),
    ("BY", "Belarus", "Europe"), ("GE", "Georgia", "Asia"), ("AM", "Armenia", "Asia"),
    ("AZ", "Azerbaijan", "Asia"), ("MN", "Mongolia", "Asia"), ("LA", "Laos", "Asia"),
    ("PY", "Paraguay", "Americas"), ("HN", "Honduras", "Americas"), ("SV", "El Salvador", "Americas"),
    ("NI", "Nicaragua", "Americas"), ("JM", "Jamaica", "Americas"),
    ("TT", "Trinidad and Tobago", "Americas"), ("CY", "Cyprus", "Europe"),
    ("LU", "Luxembourg", "Europe"), ("MT", "Malta", "Europe"), ("IS", "Iceland", "Europe"),
    ("ME", "Montenegro", "Europe"), ("BW", "Botswana", "Africa"), ("NA", "Namibia", "Africa"),
    ("MU", "Mauritius", "Africa"), ("MG", "Madagascar", "Africa"), ("ML", "Mali", "Africa"),
    ("BF", "Burkina Faso", "Africa"), ("NE", "Niger", "Africa"), ("MW", "Malawi", "Africa"),
    ("BJ", "Benin", "Africa"), ("TG", "Togo", "Africa"), ("SL", "Sierra Leone", "Africa"),
    ("LR", "Liberia", "Africa"), ("GA", "Gabon", "Africa"), ("CG", "Congo", "Africa"),
    ("FJ", "Fiji", "Oceania"), ("PG", "Papua New Guinea", "Oceania"), ("BN", "Brunei", "Asia"),
    ("BT", "Bhutan", "Asia"), ("MV", "Maldives", "Asia"), ("KG", "Kyrgyzstan", "Asia"),
    ("TJ", "Tajikistan", "Asia"), ("TM", "Turkmenistan", "Asia"), ("BZ", "Belize", "Americas"),
    ("GY", "Guyana", "Americas"), ("SR", "Suriname", "Americas"), ("BS", "Bahamas", "Americas"),
    ("BB", "Barbados", "Americas"), ("AD", "Andorra", "Europe"), ("LI", "Liechtenstein", "Europe"),
    ("MC", "Monaco", "Europe"), ("SM", "San Marino", "Europe"), ("WS", "Samoa", "Oceania"),
    ("TO", "Tonga", "Oceania"), ("VU", "Vanuatu", "Oceania"), ("SC", "Seychelles", "Africa"),
    ("CV", "Cabo Verde", "Africa"), ("KM", "Comoros", "Africa"), ("DJ", "Djibouti", "Africa"),
]


def uniform(key: str, salt: int) -> str:
    """SQL for a uniform draw in (0, 1) determined by the bigint `key` and `salt`."""
    return (
        f"((((hashint8extended(({key})::bigint, {salt}) >> 11) & 9007199254740991)::float8 + 0.5)"
        " / 9007199254740992.0)"
    )


def zipf_lower_bounds(n: int, exponent: float) -> str:
    """An SQL float8 array of bucket lower bounds for `width_bucket`: Zipf(exponent) over n ranks."""
    weights = [1.0 / (k**exponent) for k in range(1, n + 1)]
    total = sum(weights)
    bounds, acc = [], 0.0
    for w in weights:
        bounds.append(acc)
        acc += w / total
    return "ARRAY[" + ",".join(f"{b:.12f}" for b in bounds) + "]::float8[]"


def text_array(values: list[str]) -> str:
    return "ARRAY[" + ",".join("'" + v.replace("'", "''") + "'" for v in values) + "]"


def demo_schema_sql() -> list[str]:
    return [
        "DROP TABLE IF EXISTS visits, purchases, countries",
        "CREATE TABLE countries (code char(2) PRIMARY KEY, name text NOT NULL, "
        "region text NOT NULL)",
        "CREATE TABLE visits (uid bigint NOT NULL, browser text NOT NULL, "
        "country char(2) NOT NULL, duration integer)",
        "CREATE TABLE purchases (uid bigint NOT NULL, category text NOT NULL, "
        "amount numeric(10,2) NOT NULL)",
    ]


def demo_data_sql(users: int = DEMO_USERS, min_visits: int = VISITS_PER_USER_MIN) -> list[str]:
    """Statements that fill the demo tables (run after `demo_schema_sql`).

    `users` and `min_visits` (the Pareto scale of rows per user) size the data:
    the defaults give ≈ 200k visits; 100,000 users with `min_visits=4` give ≈ 2M.
    """
    codes = [c[0] for c in COUNTRIES]
    country_rows = ",".join(
        "(" + ",".join("'" + f.replace("'", "''") + "'" for f in row) + ")" for row in COUNTRIES
    )
    visit_key = "u.uid::bigint * 10000 + j"  # bigint: 10^6 users overflow int4
    alpha = VISITS_PARETO_ALPHA
    return [
        f"INSERT INTO countries VALUES {country_rows}",
        "CREATE TEMP TABLE demo_users AS SELECT uid, "
        f"least({VISITS_PER_USER_CAP}, floor({int(min_visits)} * power({uniform('uid', 1)}, "
        f"-1.0 / {alpha})))::int AS n_visits, "
        f"({text_array(codes)})[width_bucket({uniform('uid', 2)}, "
        f"{zipf_lower_bounds(len(codes), 1.6)})] AS country, "
        f"120 + 600 * {uniform('uid', 3)} AS mean_duration, "
        f"{uniform('uid', 4)} < 0.3 AS buys "
        f"FROM generate_series(1, {int(users)}) AS uid",
        "INSERT INTO visits (uid, browser, country, duration) SELECT u.uid, "
        f"({text_array(BROWSERS)})[width_bucket({uniform(visit_key, 5)}, "
        f"{zipf_lower_bounds(len(BROWSERS), 1.0)})], u.country, "
        f"CASE WHEN {uniform(visit_key, 6)} < 0.03 THEN NULL "
        f"ELSE least(3600, floor(-u.mean_duration * ln({uniform(visit_key, 7)})))::int END "
        "FROM demo_users u, generate_series(1, u.n_visits) AS j "
        "ORDER BY u.uid, j",
        "INSERT INTO purchases (uid, category, amount) SELECT u.uid, "
        f"({text_array(CATEGORIES)})[width_bucket({uniform(visit_key, 8)}, "
        f"{zipf_lower_bounds(len(CATEGORIES), 1.0)})], "
        # log-normal amounts (Box-Muller), clamped to a plausible price range
        f"least(5000, greatest(0.5, exp(3 + 1.2 * sqrt(-2 * ln({uniform(visit_key, 9)})) "
        f"* cos(2 * pi() * {uniform(visit_key, 10)}))))::numeric(10,2) "
        "FROM demo_users u, "
        f"generate_series(1, least(500, floor(power({uniform('u.uid', 11)}, -1.0 / 1.5)))::int) AS j "
        "WHERE u.buys ORDER BY u.uid, j",
        "DROP TABLE demo_users",
        "CREATE INDEX visits_uid ON visits (uid)",
        "CREATE INDEX purchases_uid ON purchases (uid)",
        "ANALYZE countries",
        "ANALYZE visits",
        "ANALYZE purchases",
    ]
