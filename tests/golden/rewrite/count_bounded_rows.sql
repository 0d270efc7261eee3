-- ANON_COUNT(*, U): each user counts up to U rows per group; ANON_COUNT(col) counts users with a value.
SELECT WITH ANONYMIZATION browser, ANON_COUNT(*, 5) AS rows5, ANON_COUNT(duration) AS with_duration FROM visits GROUP BY browser
