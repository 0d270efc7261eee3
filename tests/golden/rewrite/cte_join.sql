-- A WITH query over a protected table, joined on uid with another protected table.
WITH spenders AS (SELECT uid, sum(amount) AS spent FROM purchases GROUP BY uid) SELECT WITH ANONYMIZATION v.browser, ANON_AVG(s.spent, 0, 1000) AS avg_spent FROM visits v JOIN spenders s ON s.uid = v.uid GROUP BY v.browser
