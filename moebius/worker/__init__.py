"""The rank side: one process per GPU that schedules, runs and reports each step."""
