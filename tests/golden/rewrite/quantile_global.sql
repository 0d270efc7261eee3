-- A global quantile alone: no main statement, the tree answers it.
SELECT WITH ANONYMIZATION ANON_MAX(duration, 0, 3600) FROM visits WHERE browser = 'Firefox'
