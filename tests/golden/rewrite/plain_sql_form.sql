-- What a BI tool sends: answered as DP with the configured defaults and bounds.
SELECT country, COUNT(*), SUM(duration), AVG(duration) FROM visits GROUP BY country
