-- APPROX_BOUNDS of a mean: each user's mean is binned (divided once per kept row); a user without values is left out.
SELECT WITH ANONYMIZATION category, ANON_AVG(amount * 2) AS a FROM purchases GROUP BY category
