-- COUNT(DISTINCT x) of anything but the uid: each user's at most k distinct values per group
-- (chosen by a hash of their text), padded to k and counted once over the group's users
SELECT WITH ANONYMIZATION browser, ANON_COUNT(DISTINCT country, 3) AS countries,
       COUNT(DISTINCT country) FILTER (WHERE duration > 60) AS long_visit_countries
FROM visits GROUP BY browser
