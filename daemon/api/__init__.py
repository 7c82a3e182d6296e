"""The HTTP APIs on the daemon's Unix socket: Ollama's (hetspec's native one), OpenAI's, status
endpoints, and what keeps them bounded.
"""
