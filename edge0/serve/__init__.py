"""The OpenAI-compatible HTTP server (`edge0 serve`, edge0/cli/serve.py): server.py listens and schedules,
guard.py keeps the front door (API key, timeouts, body size), the other modules parse and answer requests."""
