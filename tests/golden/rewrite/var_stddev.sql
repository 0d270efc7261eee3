SELECT WITH ANONYMIZATION country, ANON_VAR(duration, 0, 600) AS v, ANON_STDDEV(duration, 0, 600) AS sd FROM visits GROUP BY country
