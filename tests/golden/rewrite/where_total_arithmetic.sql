-- Arithmetic becomes numeric, division goes through NULLIF: no data-dependent errors.
SELECT WITH ANONYMIZATION ANON_SUM(duration / 60, 0, 60) AS minutes FROM visits WHERE duration * 2 > 10 AND 1 / (uid - 42) > 0
