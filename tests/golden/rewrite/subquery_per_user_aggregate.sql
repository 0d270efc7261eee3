-- Per-user rows first (GROUP BY uid), then a DP histogram over them: the per-user sum is exact numeric.
SELECT WITH ANONYMIZATION s.n_visits, ANON_COUNT(*) AS users FROM (SELECT uid, count(*) AS n_visits, sum(duration) AS total FROM visits GROUP BY uid) s GROUP BY s.n_visits
