"""Agent tests: no Django, no database. They import only heteroflow_agent."""
