"""The SLA planner: sizes the prefill and decode pools for TTFT and ITL targets from the workers'
heartbeats and the roles' cost profile (policy.py, profile.py), and acts by switching workers'
roles in place, by having the launcher restart them in the other role, or only advises
(service.py)."""
