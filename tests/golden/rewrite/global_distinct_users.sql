-- A global aggregate: no contribution bounding across groups is needed.
SELECT WITH ANONYMIZATION ANON_COUNT(DISTINCT uid) AS n FROM visits
