SELECT WITH ANONYMIZATION p.category, ANON_COUNT(*) AS n FROM purchases p, visits v WHERE p.uid = v.uid AND v.browser = 'Chrome' GROUP BY p.category
