-- Two protected tables joined on their uid, and an unprotected lookup table.
SELECT WITH ANONYMIZATION c.region, ANON_SUM(p.amount, 0, 100) AS spend FROM visits v JOIN purchases p USING (uid) JOIN countries c ON c.code = v.country GROUP BY c.region
