"""The shared cluster's manager: leases workers to jobs, keeps its job table, restarts lost workers."""
