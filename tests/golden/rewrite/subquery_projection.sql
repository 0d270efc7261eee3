-- A subquery that projects and filters: the uid is propagated automatically.
SELECT WITH ANONYMIZATION s.browser, ANON_SUM(s.duration, 0, 600) AS total FROM (SELECT browser, duration FROM visits WHERE duration > 10) s GROUP BY s.browser
