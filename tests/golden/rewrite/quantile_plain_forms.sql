-- The plain form: PERCENTILE_CONT ... WITHIN GROUP, MIN and MAX with the configured bounds of duration.
SELECT browser, percentile_cont(0.9) WITHIN GROUP (ORDER BY duration DESC), min(duration), max(duration) FROM visits GROUP BY browser
