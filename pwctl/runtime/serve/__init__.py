"""The HTTP front end: the OpenAI-compatible FastAPI server, the engine worker thread it talks to
through queues, and request parsing (protocol)."""
