-- A window partitioned by the uid stays within one user's rows: each user's first visits.
SELECT WITH ANONYMIZATION s.browser, ANON_COUNT(*) AS first_visit_users FROM (SELECT uid, browser, row_number() OVER (PARTITION BY uid ORDER BY duration) AS nth FROM visits) s WHERE s.nth = 1 GROUP BY s.browser
