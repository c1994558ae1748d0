"""The HTTP server: OpenAI's completions API (app), its request body (request), its connections (connections)."""
