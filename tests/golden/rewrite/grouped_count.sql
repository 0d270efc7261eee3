-- A grouped count: the user count doubles as ANON_COUNT(*) (each user counts once per group).
SELECT WITH ANONYMIZATION browser, ANON_COUNT(*) AS n FROM visits GROUP BY browser
