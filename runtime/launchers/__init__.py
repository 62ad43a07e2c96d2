"""Launchers: where worker processes come from (this machine, Ray, a shared cluster's manager)."""
