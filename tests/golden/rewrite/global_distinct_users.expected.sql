WITH dp_per_user AS (SELECT visits.uid AS dp_uid FROM public.visits WHERE visits.uid IS NOT NULL GROUP BY 1) SELECT count(*) AS dp_users FROM dp_per_user
