-- No bounds written or configured for amount * 2: APPROX_BOUNDS histograms first (placeholder bounds in the rest).
SELECT WITH ANONYMIZATION category, ANON_SUM(amount * 2) AS s, ANON_NTILE(amount * 2, 0.25) AS q FROM purchases GROUP BY category
