-- SUM and AVG with explicit bounds, and configured bounds for duration.
SELECT WITH ANONYMIZATION OPTIONS(epsilon=2, max_groups_contributed=3) browser, ANON_SUM(duration) AS s, ANON_AVG(duration, 0, 100) AS a FROM visits GROUP BY browser
