"""User entry points: the offline LLM class and the `tokenmill` command line."""
