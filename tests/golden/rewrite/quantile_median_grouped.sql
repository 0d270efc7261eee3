-- ANON_MEDIAN with written bounds: the main statement counts users, the tree statement returns nodes.
SELECT WITH ANONYMIZATION country, ANON_MEDIAN(duration, 0, 3600) AS med FROM visits GROUP BY country
